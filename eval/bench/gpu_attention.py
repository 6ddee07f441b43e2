"""The Triton prefill attention kernel with and without key splits, in device time.

    blendkv bench gpu-attention [--heads 32:8:128,14:2:64] [--rows 30,450] [--keys 3000,6144,16384]
    blendkv bench gpu-attention --tune [--configs ...] [--tune-out TABLE]   (gpu_attention_tune)

Per (head shape, query rows, keys): one sequence whose ``rows`` new rows follow ``keys - rows``
cached keys (a reuse's or ProphetKV's query rows at 30; a 15 % blend of 3,000 tokens at 450),
bf16, blocks of 16. Correctness first (both against the torch backend), then the two take turns,
each call timed with CUDA events around it, median of ``--repeats``: the span on the device's
timeline, so it includes the call's own host work (its layout, the K/V write) where the device
waits for it -- on an H200 about 0.8 ms, the floor of every case. On the CPU
(``--device cpu``, small sizes) it checks the same under Triton's interpreter and times nothing
meaningful.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from blendkv.config import resolve_device


def _step(backend, num_heads, num_kv_heads, head_dim, computed, rows, device):
    from blendkv.kernels.attention import KVCacheSpec

    g = torch.Generator(device=device).manual_seed(0)
    block_size = 16
    num_blocks = -(-(computed + rows) // block_size)
    spec = KVCacheSpec(1, num_blocks + 1, block_size, num_kv_heads, head_dim, torch.bfloat16)
    cache = backend.allocate_kv_cache(spec)[0]
    cache.normal_(generator=g)
    table = list(range(1, num_blocks + 1))
    # a fresh metadata object per call: the backend memoises its layout per object
    md = lambda: backend.build_metadata([computed], [rows], [table], block_size)  # noqa: E731
    shape = lambda h: (rows, h, head_dim)  # noqa: E731
    q = torch.randn(shape(num_heads), device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(shape(num_kv_heads), device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(shape(num_kv_heads), device=device, dtype=torch.bfloat16, generator=g)
    return q, k, v, cache, md


def _device_ms(fn, device: str) -> float:
    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def bench_case(heads: tuple[int, int, int], rows: int, keys: int, repeats: int, device: str):
    from blendkv.config import KernelConfig
    from blendkv.kernels.torch_attention import TorchAttentionBackend
    from blendkv.kernels.triton_attention import TritonAttentionBackend

    num_heads, num_kv_heads, head_dim = heads
    ref = TorchAttentionBackend(device)
    tri = {  # the same kernel, with and without key splits
        name: TritonAttentionBackend(device, KernelConfig(prefill_split_keys=split))
        for name, split in (("split", True), ("whole", False))
    }
    q, k, v, cache, md = _step(ref, *heads, keys - rows, rows, device)
    scale = head_dim**-0.5
    expected = ref.forward(q, k, v, cache.clone(), md(), scale).float()
    calls = {}
    for name, backend in tri.items():

        def call(backend=backend):
            return backend.forward(q, k, v, cache, md(), scale)

        out = call().float()  # compiles; checked before any timing
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        calls[name] = call
    group = num_heads // num_kv_heads
    splits = tri["split"]._build_layout(md(), group, False, num_kv_heads).prefill_splits
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(_device_ms(call, device))
    row = {"heads": list(heads), "rows": rows, "keys": keys, "splits": splits}
    for name, values in times.items():
        row[f"{name}_ms"] = round(statistics.median(values), 4)
    row["speedup"] = round(row["whole_ms"] / row["split_ms"], 2)
    return row


def main(args) -> int:
    device = resolve_device(args.device)
    if args.tune:
        from blendkv.eval.bench.gpu_attention_tune import main as tune

        return tune(args, device)
    heads = [tuple(int(x) for x in h.split(":")) for h in args.heads.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    keys = [int(n) for n in args.keys.split(",")]
    results = []
    for h in heads:
        for r in rows:
            for n in keys:
                if r >= n:
                    continue
                row = bench_case(h, r, n, args.repeats, device)
                results.append(row)
                print(
                    f"heads {h[0]}/{h[1]}x{h[2]}, {r} rows over {n} keys: {row['splits']} "
                    f"parts {row['split_ms']:.3f} ms, whole {row['whole_ms']:.3f} ms "
                    f"({row['speedup']:.2f}x)",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
