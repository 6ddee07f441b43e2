"""One-off A/B (2026-11-25): MLP passes in row slices (``EngineConfig.mlp_rows_per_pass``,
default on the CPU: the rows whose gate/up output fits 24 MiB) against all rows in one pass.

Same process, alternating per request (``setup_mlp_rows`` switched between the two). Full
prefill TTFT (chunks of 2,048 tokens) and blend@0.15 TTFT (v_deviation; its full layer takes
the whole prompt at once) on MuSiQue, fp32, warm store; minor page faults of the process per
request, and the greedy tokens compared.

    .venv/bin/python eval_results/bench/amd/mlp_rows_ab.py [--model GGUF] [--limit N]
"""

import json
import resource
import statistics

from ab_common import setup

from blendkv.blend.config import BlendConfig
from blendkv.engine.cpu_speedups import setup_mlp_rows

args, llm, manager, _, one, prompts = setup(repeats=2)
cfg = BlendConfig(selection="v_deviation", recompute_ratio=0.15)
engine = llm.engine
default_rows = engine.mlp_rows_per_pass
assert default_rows, "slicing is off on this device"
modes = {"sliced": None, "one_pass": 0}


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


rows = []
for i, p in enumerate(prompts):
    ids = list(manager.prepare(p, cfg).prompt.token_ids)
    llm.generate([p], one, blend=cfg)  # this config's first run
    res = {m: {"full": [], "blend": [], "faults_full": [], "faults_blend": []} for m in modes}
    tokens = {}
    for _ in range(args.repeats):
        for mode, value in modes.items():
            setup_mlp_rows(engine.model, value, engine.torch_dtype, engine.device)
            f0 = faults()
            full = llm.generate([ids], one)[0]
            f1 = faults()
            blend = llm.generate([p], one, blend=cfg)[0]
            res[mode]["faults_full"].append(f1 - f0)
            res[mode]["faults_blend"].append(faults() - f1)
            res[mode]["full"].append(full.metrics.ttft)
            res[mode]["blend"].append(blend.metrics.ttft)
            tokens[mode] = (full.outputs[0].token_ids, blend.outputs[0].token_ids)
    setup_mlp_rows(engine.model, None, engine.torch_dtype, engine.device)
    row = {"example": i, "tokens": len(ids), "rows_per_pass": default_rows}
    row["same_tokens"] = tokens["sliced"] == tokens["one_pass"]
    for mode, d in res.items():
        row.update({f"{k}_{mode}": statistics.median(v) for k, v in d.items()})
    row["full_sliced_over_one_pass"] = row["full_sliced"] / row["full_one_pass"]
    row["blend_sliced_over_one_pass"] = row["blend_sliced"] / row["blend_one_pass"]
    rows.append(row)
    print(json.dumps(row), flush=True)
print(
    json.dumps(
        {
            f"median_{k}": statistics.median(r[k] for r in rows)
            for k in ("full_sliced_over_one_pass", "blend_sliced_over_one_pass")
        }
    )
)
