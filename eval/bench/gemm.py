"""CPU GEMM libraries at a model's shapes: what ``blendkv.layers.cpu_platform`` chooses between.

    blendkv bench gemm [--model PATH] [--rows 1,32,2048] [--threads 2]

For each linear map of one decoder layer (fused q/k/v, o_proj, fused gate/up, down) and the
lm_head, and each batch size, times ``F.linear`` (torch's own: MKL's sgemm in float32), MKL's
packed sgemm (float32, packed for the batch size, as ``CpuTuning.packed_gemm_rows`` does) and
oneDNN on a weight reordered once (``cpu_gemm="onednn"``), in float32 and bfloat16: the
calls take turns,
median of ``--repeats`` calls each. Random weights of the model's shapes (no checkpoint is
read). Correctness first (it also warms each call up): every result is compared with
``F.linear`` in float64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _time_interleaved(calls: dict, repeats: int, before=None) -> dict[str, float]:
    """Median seconds of each call, the calls taking turns (machine noise hits all alike);
    ``before()`` runs untimed before each call."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(repeats):
        for label, fn in calls.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(ts) for label, ts in times.items()}


def shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of the linear maps of one layer and the lm_head."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {
        "q/k/v": (h, q + 2 * kv),
        "o_proj": (q, h),
        "gate/up": (h, 2 * inter),
        "down": (inter, h),
        "lm_head": (h, config.vocab_size),
    }


def main(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from blendkv.layers.linear import cpu_vendor, onednn_gemm_available, packed_gemm_available
    from blendkv.models.model_files import load_config, resolve_model

    torch.set_num_threads(args.threads)
    config = load_config(resolve_model(args.model))
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    print(
        f"{cpu_vendor()}, {torch.backends.cpu.get_cpu_capability()}, "
        f"avx512_bf16={bool(caps.get('avx512_bf16'))}, {args.threads} threads; times in ms"
    )
    rows_list = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    results = []
    print(f"{'map':8} {'rows':>5} {'dtype':9} {'F.linear':>9} {'MKL packed':>11} {'oneDNN':>8}")
    for name, (n_in, n_out) in shapes(config).items():
        w32 = torch.randn(n_out, n_in, generator=gen) / n_in**0.5
        for rows in rows_list:
            x32 = torch.randn(rows, n_in, generator=gen)
            for dtype in (torch.float32, torch.bfloat16):
                w, x = w32.to(dtype), x32.to(dtype)
                ref = F.linear(x.double(), w.double())
                row = {"map": name, "rows": rows, "dtype": str(dtype).split(".")[1]}
                calls = {"F.linear": lambda w=w, x=x: F.linear(x, w)}
                if dtype == torch.float32 and packed_gemm_available(dtype, "cpu"):
                    mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
                    calls["MKL packed"] = lambda w=w, x=x, m=mkl, r=rows: torch.ops.mkl._mkl_linear(
                        x, m, w, None, r
                    )
                if onednn_gemm_available(dtype, "cpu"):
                    one = torch.ops.mkldnn._reorder_linear_weight(w, rows)
                    calls["oneDNN"] = lambda x=x, o=one: torch.ops.mkldnn._linear_pointwise(
                        x, o, None, "none", [], ""
                    )
                tol = 1e-3 if dtype == torch.float32 else 0.1
                for label, fn in calls.items():
                    err = (fn().double() - ref).abs().max().item()
                    assert err < tol * max(1.0, ref.abs().max().item()), (name, label, err)
                for label, seconds in _time_interleaved(calls, args.repeats).items():
                    row[label] = seconds * 1e3
                results.append(row)
                cells = [
                    f"{row[k]:>{width}.3f}" if k in row else f"{'-':>{width}}"
                    for k, width in (("F.linear", 9), ("MKL packed", 11), ("oneDNN", 8))
                ]
                print(f"{name:8} {rows:>5} {row['dtype']:9} {' '.join(cells)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gemm_bench": results, "vendor": cpu_vendor()}, f, indent=2)
    return 0
