"""One-off A/B (2026-11-25): the blend's K correction through the C++ kernel
(``kernels/cpu/chunk_shift.cpp``, ``TorchAttentionBackend.shift_kept_rows``) against the torch
code of ``blendkv.blend.correction``.

Same process, alternating per request (the backend's ``shift_kept_rows`` patched to decline
for the torch mode). Blend TTFT at CacheBlend's blend@0.15 with the default K correction
(MuSiQue, fp32, warm store) and the first answer token's logits compared.

    .venv/bin/python eval_results/bench/amd/chunk_shift_ab.py [--model GGUF] [--limit N]
"""

import json
import statistics

from ab_common import setup

from blendkv.blend.config import BlendConfig

args, llm, manager, _, one, prompts = setup(repeats=3)
cfg = BlendConfig(selection="v_deviation", recompute_ratio=0.15)
backend = llm.engine.attn_backend
assert backend.fused_chunk_shift, "the C++ kernels did not build"
kernel = backend.shift_kept_rows
modes = {"cpp": kernel, "torch": lambda *a: False}
rows = []
for i, p in enumerate(prompts):
    n = len(manager.prepare(p, cfg).prompt.token_ids)
    llm.generate([p], one, blend=cfg)  # this config's first run
    ttft = {m: [] for m in modes}
    logits = {}
    for _ in range(args.repeats):
        for mode, fn in modes.items():
            backend.shift_kept_rows = fn
            out = llm.generate([p], one, blend=cfg, logits_from=n - 1)[0]
            ttft[mode].append(out.metrics.ttft)
            logits[mode] = out.extra["prompt_logits"]
    backend.shift_kept_rows = kernel
    diff = float((logits["cpp"] - logits["torch"]).abs().max())
    row = {"example": i, "tokens": n, "max_logit_diff": diff}
    row.update({f"ttft_{m}": statistics.median(v) for m, v in ttft.items()})
    row["cpp_over_torch"] = row["ttft_cpp"] / row["ttft_torch"]
    rows.append(row)
    print(json.dumps(row), flush=True)
print(json.dumps({"median_cpp_over_torch": statistics.median(r["cpp_over_torch"] for r in rows)}))
