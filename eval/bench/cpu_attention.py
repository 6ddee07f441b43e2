"""The CPU attention paths side by side: the torch reference's, the C++ kernels', and the eager
paths removed from the torch backend (kept here only to be measured against).

    blendkv bench attention [--threads 2] [--repeats 7]

SmolLM2's heads (9 query heads on 3 KV heads, D 64), float32. Correctness first (every path
against the reference, also the warm-up), then the calls take turns (machine noise hits all
alike), median ms of ``--repeats`` each, one JSON line per case:

- ``decode``: 32 decode rows of 300-982 keys in blocks of 16 whose block tables lie in 1, 4, 8
  or 32 runs of consecutive ids: in place over pool slices, gathered padded SDPA (the reference
  for rows in more than ``paged_decode.MAX_RUNS`` runs), the C++ decode kernel;
- ``rows``: 656 scattered rows and a 64-token tail over 6,300 keys: split attention (the
  reference), the removed grouped masked SDPA, the C++ rows kernel;
- ``causal``: a fresh 2,048-token prefill: SDPA's causal flash kernel, the C++ rows kernel;
- ``query``: ProphetKV's query pass at one layer, 55 rows at the end of 6,300 keys with the
  mass they pay each key: the torch reference, the C++ kernel recomputing the scores for the
  mass, the C++ kernel keeping the attention pass's probabilities;
- ``block rows``: the C++ kernel with 32 rows per task against its default
  (:func:`~blendkv.kernels.cpu_prefill.block_rows`) for the scattered rows and a 6,300-token
  causal prefill (few rows, as the query pass's, are split finer either way), with the caches
  warm and with 64 MiB touched before each call (cold, as between a forward's layers);
- ``dtype``: the C++ kernel on the same rows in float32 and in bfloat16.
"""

from __future__ import annotations

import argparse
import json

import torch

from blendkv.eval.bench.gemm import _time_interleaved
from blendkv.kernels import paged_decode
from blendkv.kernels.attention import AttentionMetadata
from blendkv.kernels.attention_mass import attention_with_mass
from blendkv.kernels.cpu_decode import DecodeKernel, dense_decode_layout
from blendkv.kernels.cpu_prefill import RowsKernel, block_rows
from blendkv.kernels.split_attention import build_row_groups, split_masked_attention
from blendkv.kernels.torch_attention import dense_causal_attention, masked_attention

HQ, HKV, D, BS = 9, 3, 64, 16
SCALE = D**-0.5


def grouped_masked_attention(q, keys, values, positions, scale):
    """The removed path: rows in up to 8 groups of >= 64, each over the keys up to its last."""
    n = q.shape[0]
    num_groups = max(1, min(8, n // 64))
    bounds = [round(g * n / num_groups) for g in range(num_groups + 1)]
    out = torch.empty_like(q)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        end = int(positions[hi - 1]) + 1
        out[lo:hi] = masked_attention(q[lo:hi], keys[:end], values[:end], positions[lo:hi], scale)
    return out


def decode_case(runs: int) -> tuple[dict, torch.Tensor]:
    lens = [300 + 22 * i for i in range(32)]
    blocks = [-(-n // BS) for n in lens]
    kv = torch.randn(2, 2 * sum(blocks) + 64, BS, HKV, D)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    nxt = 0
    for i, n in enumerate(blocks):
        per = max(1, -(-n // runs))
        for j in range(n):
            nxt += 1 if j and j % per == 0 else 0  # a gap: a new run
            table[i, j] = nxt
            nxt += 1
    rows = len(lens)
    md = AttentionMetadata(
        positions=torch.tensor([n - 1 for n in lens]),
        slot_mapping=torch.zeros(rows, dtype=torch.long),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        block_size=BS,
        max_query_len=1,
        max_seq_len=max(lens),
        query_start_loc_cpu=list(range(rows + 1)),
        seq_lens_cpu=lens,
        is_contiguous_prefill=[True] * rows,
    )
    q, seqs, kernel = torch.randn(rows, HQ, D), list(range(rows)), DecodeKernel()
    in_place = paged_decode.decode_layout(md, seqs, kv.shape, True, max_runs=1 << 30)
    gathered = paged_decode.decode_layout(md, seqs, kv.shape, False)
    dense = dense_decode_layout(md, seqs, BS)
    out = torch.empty_like(q)
    calls = {
        "in_place": lambda: paged_decode.decode_attention(q, kv, in_place, out, SCALE),
        "gathered": lambda: paged_decode.decode_attention(q, kv, gathered, out, SCALE),
        "cpp": lambda: kernel(q, kv, dense, out, SCALE),
    }
    return calls, out


def check_and_time(case: str, calls: dict, out_of, repeats: int, before=None, tol=1e-4) -> dict:
    results = []
    for fn in calls.values():  # correctness first (and the warm-up)
        results.append(out_of(fn).float().clone())
    for got in results[1:]:
        torch.testing.assert_close(got, results[0], atol=tol, rtol=tol)
    ms = {k: v * 1e3 for k, v in _time_interleaved(calls, repeats, before).items()}
    first = next(iter(ms))
    ratios = {f"{k}/{first}": round(v / ms[first], 2) for k, v in ms.items() if k != first}
    return {"case": case, "ms": {k: round(v, 2) for k, v in ms.items()}, **ratios}


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = {"threads": args.threads, "cpu": torch.backends.cpu.get_cpu_capability()}
    for runs in (1, 4, 8, 32):
        calls, out = decode_case(runs)
        row = check_and_time(f"decode32_runs{runs}", calls, lambda f, o=out: f() or o, args.repeats)
        print(json.dumps({**info, **row}))
    keys, values = torch.randn(6300, HKV, D), torch.randn(6300, HKV, D)
    scattered = torch.randperm(6300 - 64)[:656].sort().values
    positions = torch.cat([scattered, torch.arange(6300 - 64, 6300)])
    q, rows = torch.randn(len(positions), HQ, D), RowsKernel()
    groups = build_row_groups(positions, HQ // HKV, q.dtype)
    out = torch.empty_like(q)
    calls = {
        "split": lambda: split_masked_attention(q, keys, values, positions, SCALE, groups),
        "grouped_masked": lambda: grouped_masked_attention(q, keys, values, positions, SCALE),
        "cpp": lambda: rows(q, keys, values, positions, SCALE, out) or out,
    }
    print(
        json.dumps(
            {**info, **check_and_time("rows720_over6300", calls, lambda f: f(), args.repeats)}
        )
    )
    n = 2048
    q, k, v = torch.randn(n, HQ, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    calls = {
        "sdpa": lambda: dense_causal_attention(q, k, v, SCALE),
        "cpp": lambda: rows.causal(q, k, v, SCALE, out2) or out2,
    }
    out2 = torch.empty_like(q)
    print(json.dumps({**info, **check_and_time("causal2048", calls, lambda f: f(), args.repeats)}))
    query = torch.arange(6300 - 55, 6300)
    q = torch.randn(len(query), HQ, D)
    print(
        json.dumps(
            {
                **info,
                **check_and_time(
                    "query55_over6300",
                    _query_calls(q, keys, values, query),
                    lambda f: f(),
                    args.repeats,
                ),
            }
        )
    )
    # As in a forward, where the layers between two calls evict their keys: 64 MiB touched
    # before each timed call (cold), and without it (warm).
    junk = torch.zeros(16 << 20)
    for name, pos in (("rows720", positions), ("causal6300", None)):
        pos = torch.arange(6300) if pos is None else pos
        q = torch.randn(len(pos), HQ, D)
        calls = _block_rows_calls(q, keys, values, pos, rows.ops)
        for cache, before in (("warm", None), ("cold", lambda: junk.add_(1.0))):
            case = f"{name}_over6300_block_rows_{cache}"
            row = check_and_time(case, calls, lambda f: f(), args.repeats, before)
            print(json.dumps({**info, **row}))
    # The kernel on the same rows in float32 and in bfloat16 (with AVX512-BF16: q.k as bf16 pair
    # dot products), outputs equal to bfloat16's rounding.
    for name, pos in (("rows720", positions), ("causal6300", torch.arange(6300))):
        q = torch.randn(len(pos), HQ, D)
        calls = _dtype_calls(q, keys, values, pos, rows)
        row = check_and_time(f"{name}_over6300_dtype", calls, lambda f: f(), args.repeats, tol=3e-2)
        print(json.dumps({**info, **row}))


def _dtype_calls(q, keys, values, positions, kernel) -> dict:
    calls = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        qd, kd, vd = (t.to(dtype) for t in (q, keys, values))
        out = torch.empty_like(qd)
        calls[name] = lambda qd=qd, kd=kd, vd=vd, out=out: (
            kernel(qd, kd, vd, positions, SCALE, out) or out
        )
    return calls


def _query_calls(q, keys, values, positions) -> dict:
    """The query rows' output and mass, side by side ([out, mass] flattened)."""
    recompute, keep, out = RowsKernel(max_prob_floats=0), RowsKernel(), torch.empty_like(q)

    def cpp(kernel):
        mass = torch.zeros(keys.shape[0])
        kernel(q, keys, values, positions, SCALE, out, mass)
        return torch.cat([out.flatten(), mass])

    def reference():
        o, mass = attention_with_mass(q, keys, values, positions, scale=SCALE)
        return torch.cat([o.flatten(), mass])

    return {
        "torch": reference,
        "cpp_recomputed": lambda: cpp(recompute),
        "cpp_kept": lambda: cpp(keep),
    }


def _block_rows_calls(q, keys, values, positions, ops) -> dict:
    """The op with 32 rows per task and with its default."""
    out, default = torch.empty_like(q), block_rows(HQ // HKV)

    def call(rows_per_task):
        ops.rows_attention(q, keys, values, positions, SCALE, rows_per_task, out, None, 0, 0.0)
        return out

    return {"rows32": lambda: call(32), f"rows{default}": lambda: call(default)}
