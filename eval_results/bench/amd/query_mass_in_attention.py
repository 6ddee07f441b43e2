"""One-off A/B (2026-11-25): ProphetKV's query pass scoring inside the torch backend's
attention (one q.K product per layer gives the query rows' output and their mass) against
scoring before attention (a second q.K product and softmax per layer, the code before).

Same process, alternating; the torch backend's ``scores_in_attention`` switches the path.
Reports TTFT medians, whether the same rows were recomputed (a different float rounding of
the pass may flip near-ties) and the largest difference of the first answer token's logits.

    .venv/bin/python eval_results/bench/amd/query_mass_in_attention.py [--model GGUF] [--limit N]
"""

import json
import statistics

from ab_common import setup

from blendkv.kernels.torch_attention import TorchAttentionBackend

args, llm, manager, cfg, one, prompts = setup(repeats=3)
rows = []
modes = {"in_attention": True, "separate": False}
for i, p in enumerate(prompts):
    n = len(manager.prepare(p, cfg).prompt.token_ids)
    ttft, logits, recomputed = {m: [] for m in modes}, {}, {}
    for _ in range(args.repeats):
        for mode, flag in modes.items():
            TorchAttentionBackend.scores_in_attention = flag
            out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
            ttft[mode].append(out.metrics.ttft)
            logits[mode] = out.extra["prompt_logits"]
            recomputed[mode] = out.blend_stats.reused_tokens_recomputed
    TorchAttentionBackend.scores_in_attention = True
    row = {
        "example": i,
        "tokens": n,
        "max_logit_diff": float((logits["in_attention"] - logits["separate"]).abs().max()),
        "same_argmax": bool(logits["in_attention"].argmax() == logits["separate"].argmax()),
        "recomputed": recomputed,
    }
    row.update({f"ttft_{m}": statistics.median(v) for m, v in ttft.items()})
    row["ratio"] = row["ttft_in_attention"] / row["ttft_separate"]
    rows.append(row)
    print(json.dumps(row), flush=True)
print(json.dumps({"median_ratio": statistics.median(r["ratio"] for r in rows)}))
