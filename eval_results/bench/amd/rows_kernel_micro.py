"""One-off microbenchmark (2026-11-25): the C++ prefill kernel (``rows_attention``) against the
eager CPU paths it replaces, one layer's attention at MuSiQue sizes (6,300 keys).

- scattered: 630 rows at random positions + a 90-row query tail (CacheBlend's recomputed rows
  at R = 0.10), against ``split_masked_attention`` (row groups: unmasked prefix + masked band);
- causal: a 6,300-token fresh prefill, against SDPA's causal flash kernel.

SmolLM2's heads (9 on 3 KV heads) and Qwen2.5-0.5B's (14 on 2), head dim 64, float32 and
bfloat16; each result checked against the eager path first; ms per call, median of 5.

    .venv/bin/python eval_results/bench/amd/rows_kernel_micro.py
"""

import json
import statistics
import time

import torch

from blendkv.kernels.compiled_prefill import CompiledPrefill
from blendkv.kernels.split_attention import plan_row_groups, split_masked_attention
from blendkv.kernels.torch_attention import dense_causal_attention


def timed(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


kernel = CompiledPrefill()
S, D = 6300, 64
gen = torch.Generator().manual_seed(1)
picked = torch.randperm(S - 100, generator=gen)[:630].sort().values
layouts = {"scattered": torch.cat([picked, torch.arange(S - 90, S)]), "causal": torch.arange(S)}
for dtype in (torch.float32, torch.bfloat16):
    for heads, kv_heads in ((9, 3), (14, 2)):
        k = torch.randn(S, kv_heads, D, generator=gen).to(dtype)
        v = torch.randn(S, kv_heads, D, generator=gen).to(dtype)
        for layout, pos in layouts.items():
            q = torch.randn(len(pos), heads, D, generator=gen).to(dtype)
            out = torch.empty_like(q)
            if layout == "causal":

                def eager(q=q, k=k, v=v):
                    return dense_causal_attention(q, k, v, D**-0.5)
            else:
                groups = plan_row_groups(pos, heads // kv_heads, dtype)

                def eager(q=q, k=k, v=v, pos=pos, groups=groups):
                    return split_masked_attention(q, k, v, pos, D**-0.5, groups)

            kernel(q, k, v, pos, D**-0.5, out)
            err = float((out.float() - eager().float()).abs().max())
            assert err < (1e-5 if dtype == torch.float32 else 3e-2), err
            ms_kernel = timed(
                lambda q=q, k=k, v=v, pos=pos, out=out: kernel(q, k, v, pos, D**-0.5, out)
            )
            ms_eager = timed(eager)
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "heads": f"{heads}/{kv_heads}",
                "layout": layout,
                "max_abs_diff": err,
                "kernel_ms": round(ms_kernel, 2),
                "eager_ms": round(ms_eager, 2),
                "speedup": round(ms_eager / ms_kernel, 3),
            }
            print(json.dumps(row), flush=True)
