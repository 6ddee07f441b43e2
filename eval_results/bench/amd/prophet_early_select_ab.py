"""One-off A/B (2026-11-25): ProphetKV picking its rows before layer 0's input norm and Q/K/V
(``BlendRowPlan.selects_before_projection``) against picking after them (every row projected
at layer 0, the dropped ones for nothing).

Same process, alternating per request (the method patched on the class for the "after" side).
The default ``BlendConfig()`` (ProphetKV at 0.10, K correction) on MuSiQue, fp32, warm store;
the greedy first tokens and the last row's logits compared.

    .venv/bin/python eval_results/bench/amd/prophet_early_select_ab.py [--model GGUF] [--limit N]
"""

import json
import statistics

from ab_common import setup

from blendkv.blend.row_plan import BlendRowPlan

args, llm, manager, cfg, one, prompts = setup(repeats=3)
early = BlendRowPlan.selects_before_projection
modes = {"before": early, "after": lambda self, layer_idx: False}

rows = []
for i, p in enumerate(prompts):
    n = len(manager.prepare(p, cfg).prompt.token_ids)
    res = {m: [] for m in modes}
    tokens, logits = {}, {}
    for _ in range(args.repeats):
        for mode, method in modes.items():
            BlendRowPlan.selects_before_projection = method
            out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
            res[mode].append(out.metrics.ttft)
            tokens[mode] = out.outputs[0].token_ids
            logits[mode] = out.extra["prompt_logits"]
    BlendRowPlan.selects_before_projection = early
    row = {"example": i, "tokens": n, "same_tokens": tokens["before"] == tokens["after"]}
    row["logits_max_diff"] = float((logits["before"] - logits["after"]).abs().max())
    row.update({f"blend_{m}": statistics.median(v) for m, v in res.items()})
    row["before_over_after"] = row["blend_before"] / row["blend_after"]
    rows.append(row)
    print(json.dumps(row), flush=True)
print(
    json.dumps(
        {"median_before_over_after": statistics.median(r["before_over_after"] for r in rows)}
    )
)
