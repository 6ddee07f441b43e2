"""One-off A/B (2026-11-25): the pruned last layer (``EngineConfig.prune_last_layer``, the
default: attention, o_proj and MLP only for the rows a step reads) against every row through it.

Same process, alternating per request (the runner's switch flipped between the two). Full
prefill TTFT and blend@0.15 TTFT (v_deviation) on MuSiQue, fp32, warm store; the greedy first
tokens and their logits compared.

    .venv/bin/python eval_results/bench/amd/prune_last_layer_ab.py [--model GGUF] [--limit N]
"""

import json
import statistics

from ab_common import setup

from blendkv.blend.config import BlendConfig

args, llm, manager, _, one, prompts = setup(repeats=3)
cfg = BlendConfig(selection="v_deviation", recompute_ratio=0.15)
runner = llm.engine.runner
modes = {"pruned": True, "every_row": False}

rows = []
for i, p in enumerate(prompts):
    ids = list(manager.prepare(p, cfg).prompt.token_ids)
    llm.generate([p], one, blend=cfg)  # this config's first run
    res = {m: {"full": [], "blend": []} for m in modes}
    tokens, logits = {}, {}
    for _ in range(args.repeats):
        for mode, value in modes.items():
            runner.prune_last_layer = value
            full = llm.generate([ids], one, logits_from=len(ids) - 1)[0]
            blend = llm.generate([p], one, blend=cfg)[0]
            res[mode]["full"].append(full.metrics.ttft)
            res[mode]["blend"].append(blend.metrics.ttft)
            tokens[mode] = (full.outputs[0].token_ids, blend.outputs[0].token_ids)
            logits[mode] = full.extra["prompt_logits"]
    runner.prune_last_layer = True
    row = {"example": i, "tokens": len(ids)}
    row["same_tokens"] = tokens["pruned"] == tokens["every_row"]
    row["full_logits_max_diff"] = float((logits["pruned"] - logits["every_row"]).abs().max())
    for mode, d in res.items():
        row.update({f"{k}_{mode}": statistics.median(v) for k, v in d.items()})
    row["full_pruned_over_every_row"] = row["full_pruned"] / row["full_every_row"]
    row["blend_pruned_over_every_row"] = row["blend_pruned"] / row["blend_every_row"]
    rows.append(row)
    print(json.dumps(row), flush=True)
print(
    json.dumps(
        {
            f"median_{k}": statistics.median(r[k] for r in rows)
            for k in ("full_pruned_over_every_row", "blend_pruned_over_every_row")
        }
    )
)
