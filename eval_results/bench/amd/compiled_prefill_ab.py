"""One-off A/B (2026-11-25): prefill attention through the C++ kernel
(``EngineConfig.compile_prefill``, ``kernels/cpu/rows_attention.cpp``) against the eager
paths (SDPA's causal flash for fresh prefills, the split flash calls for scattered rows).

Same process, alternating per request: the backend's ``compiled_prefill`` is set or cleared.
Full prefill and blend TTFT (MuSiQue, fp32, warm store), the first answer token's logits
compared, and the blend's greedy first token.

    .venv/bin/python eval_results/bench/amd/compiled_prefill_ab.py [--model GGUF] [--limit N]
"""

import json
import statistics

from ab_common import setup

args, llm, manager, cfg, one, prompts = setup(repeats=2)
backend = llm.engine.attn_backend
kernel = backend.compiled_prefill
assert kernel is not None, "the prefill kernel did not build"
rows = []
modes = {"kernel": kernel, "eager": None}
for i, p in enumerate(prompts):
    ids = manager.prepare(p, cfg).prompt.token_ids
    n = len(ids)
    ttft = {f"{kind}_{m}": [] for kind in ("full", "blend") for m in modes}
    logits, first = {}, {}
    for _ in range(args.repeats):
        for mode, k in modes.items():
            backend.compiled_prefill = k
            out = llm.generate([ids], one, logits_from=n - 1)[0]
            ttft[f"full_{mode}"].append(out.metrics.ttft)
            logits[f"full_{mode}"] = out.extra["prompt_logits"]
            out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
            ttft[f"blend_{mode}"].append(out.metrics.ttft)
            logits[f"blend_{mode}"] = out.extra["prompt_logits"]
            first[mode] = out.outputs[0].token_ids
    backend.compiled_prefill = kernel
    row = {"example": i, "tokens": n, "same_first_token": first["kernel"] == first["eager"]}
    for kind in ("full", "blend"):
        diff = (logits[f"{kind}_kernel"] - logits[f"{kind}_eager"]).abs().max()
        row[f"{kind}_max_logit_diff"] = float(diff)
    row.update({k: statistics.median(v) for k, v in ttft.items()})
    row["full_speedup"] = row["full_eager"] / row["full_kernel"]
    row["blend_speedup"] = row["blend_eager"] / row["blend_kernel"]
    rows.append(row)
    print(json.dumps(row), flush=True)
summary = {
    f"median_{k}": statistics.median(r[k] for r in rows) for k in ("full_speedup", "blend_speedup")
}
print(json.dumps(summary))
