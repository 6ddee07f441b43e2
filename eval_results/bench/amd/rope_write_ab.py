"""One-off A/B (2026-11-25): a blend's loaded chunk K/V rotated into the pool by the C++ pass
(``kernels/cpu/rope_write.cpp``) or by the torch code, each pipelined (a loader thread beside
the forward) or serial (all written before the forward).

Same process, alternating per request (``rope_write_applies`` patched to refuse for the torch
modes, ``kv_connector.pipelined`` switched). Blend TTFT (MuSiQue, fp32, warm store), the load
seconds the stats report and the part hidden, and the first answer token's logits compared
across the four modes (they must be identical).

    .venv/bin/python eval_results/bench/amd/rope_write_ab.py [--model GGUF] [--limit N]
"""

import json
import statistics

from ab_common import setup

import blendkv.kernels.compiled_blend as compiled_blend

args, llm, manager, cfg, one, prompts = setup(repeats=3)
assert llm.engine.attn_backend.compiled_prefill is not None, "the C++ kernels did not build"
applies = compiled_blend.rope_write_applies
connector = llm.engine.kv_connector
modes = {
    "cpp_pipe": (applies, True),
    "torch_pipe": (lambda *a: False, True),
    "cpp_serial": (applies, False),
    "torch_serial": (lambda *a: False, False),
}
rows = []
for i, p in enumerate(prompts):
    n = len(manager.prepare(p, cfg).prompt.token_ids)
    ttft = {m: [] for m in modes}
    load = {m: [] for m in modes}
    hidden = {m: [] for m in modes}
    logits = {}
    for _ in range(args.repeats):
        for mode, (fn, pipelined) in modes.items():
            compiled_blend.rope_write_applies = fn
            connector.pipelined = pipelined
            out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
            ttft[mode].append(out.metrics.ttft)
            stats = out.blend_stats
            load[mode].append(stats.write_seconds)
            hidden[mode].append(stats.load_hidden_seconds)
            logits[mode] = out.extra["prompt_logits"]
    compiled_blend.rope_write_applies = applies
    connector.pipelined = True
    ref = logits["torch_serial"]
    row = {"example": i, "tokens": n}
    row["identical_logits"] = all(bool((v == ref).all()) for v in logits.values())
    for m in modes:
        row[f"ttft_{m}"] = statistics.median(ttft[m])
        row[f"write_{m}"] = statistics.median(load[m])
        row[f"hidden_{m}"] = statistics.median(hidden[m])
    rows.append(row)
    print(json.dumps(row), flush=True)
summary = {f"median_ttft_{m}": statistics.median(r[f"ttft_{m}"] for r in rows) for m in modes}
print(json.dumps(summary))
