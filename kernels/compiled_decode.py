"""Decode rows on the CPU through one compiled kernel per layer (``EngineConfig.compile_decode``).

The eager CPU paths (:mod:`paged_decode`) attend each decode row with its own flash call: ~70-90
us a call, 32 rows x 30 layers a step, for a few hundred thousand FLOPs each. Here every decode
row of a step is attended by one function, compiled by ``torch.compile`` (inductor): it reads
each row's keys through its slots in the pool (the gather is fused into the reductions, no
copy of the K/V is made), masks the padding past the row's length, and sums over the keys.

    slots [R, L]: pool slots of row r's keys 0..L-1 (block table x block size + offset);
                  past ``lens[r]`` they point anywhere in the pool and are masked
    q [R, Hkv, G, D] x keys[slots] [R, L, Hkv, D] -> scores [R, L, Hkv, G] -> softmax over L
    -> x values[slots] -> [R, Hkv, G, D]

Rows are padded to the longest context of their call: one call for every decode row of the
step, or two when splitting them by context length pads far fewer keys. Measured for 32 rows
of 96-544 keys at SmolLM2's heads, two threads, one call: 1.05-1.3 ms a layer against 2.0-2.4
ms for the per-row flash calls (``python -m blendkv.eval.bench_decode_paths --compare
compiled``). The function is the reference too: eager, it runs where compiling fails (logged
once), and the tests compare both with the dense float64 oracle. Float32 pools only. The first
call compiles (~20 s on these 2-core machines; inductor caches the kernel on disk for later
processes), and a batch of one row compiles once more.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from blendkv.kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def dense_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q`` [R, Hkv, G, D]; ``keys``/``values`` [pool slots, Hkv, D] (one layer's pool);
    ``slots`` [R, L] int64; ``lens`` [R] real keys per row (>= 1) -> [R, Hkv, G, D]."""
    k = keys[slots]  # [R, L, Hkv, D]; compiled, the gather is fused into the sums below
    v = values[slots]
    scores = (q[:, None] * k[:, :, :, None, :]).sum(-1) * scale  # [R, L, Hkv, G]
    visible = torch.arange(slots.shape[1], device=slots.device)[None, :] < lens[:, None]
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    return (probs[..., None] * v[:, :, :, None, :]).sum(1)


@dataclass(frozen=True)
class DenseDecode:
    """A step's decode rows, attended together by :class:`CompiledDecode`."""

    rows: torch.Tensor  # [R] int64 token rows
    slots: torch.Tensor  # [R, L] int64, L = the longest context among them
    lens: torch.Tensor  # [R] int64


def plan_dense_decode(md: AttentionMetadata, seqs: list[int], block_size: int) -> list[DenseDecode]:
    """The slots of every key of the decode sequences ``seqs``, from their block tables, in
    one or two buckets of similar context lengths (:func:`length_buckets`)."""
    return [
        _bucket(md, [seqs[i] for i in bucket], block_size)
        for bucket in length_buckets([md.seq_lens_cpu[i] for i in seqs])
    ]


def length_buckets(lens: list[int], min_rows: int = 2, min_saving: float = 0.15) -> list[list[int]]:
    """Indices into ``lens`` as one bucket, or two (shorter contexts, longer ones) where that
    pads at least ``min_saving`` fewer keys: a call pads every row to its longest context.

    Each bucket has at least ``min_rows`` rows and contexts of at least 2 keys (a dimension of
    size 1 would compile the kernel again). Measured at 32 rows of 96-576 keys: two calls
    1.32-1.38 ms a layer against 1.65-1.70 ms for one."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    n, longest = len(lens), max(lens, default=0)
    best, cut = n * longest, None
    for c in range(min_rows, n - min_rows + 1):
        short = lens[order[c - 1]]
        cost = c * short + (n - c) * longest
        if short >= 2 and cost < best:
            best, cut = cost, c
    if cut is None or best > (1 - min_saving) * n * longest:
        return [list(range(n))]
    return [sorted(order[:cut]), sorted(order[cut:])]


def _bucket(md: AttentionMetadata, seqs: list[int], block_size: int) -> DenseDecode:
    dev = md.positions.device
    idx = torch.tensor(seqs, dtype=torch.long, device=dev)
    longest = max(md.seq_lens_cpu[i] for i in seqs)
    num_blocks = -(-longest // block_size)
    table = md.block_table[idx, :num_blocks].long()  # zeros past a row's own blocks: masked
    offsets = torch.arange(block_size, device=dev)
    slots = (table[:, :, None] * block_size + offsets).reshape(len(seqs), -1)[:, :longest]
    rows = torch.tensor([md.query_start_loc_cpu[i] for i in seqs], dtype=torch.long, device=dev)
    return DenseDecode(rows, slots.contiguous(), md.seq_lens[idx].long())


class CompiledDecode:
    """:func:`dense_decode_attention` compiled once (dynamic shapes: any number of rows and
    keys); if compiling fails the reason is logged and the eager function is used."""

    def __init__(self) -> None:
        self._fn = None
        self.failed: str | None = None

    def __call__(self, q, kv_cache, plan: DenseDecode, out, scale) -> None:
        _, _, _, num_kv_heads, head_dim = kv_cache.shape
        pool = kv_cache.view(2, -1, num_kv_heads, head_dim)
        qd = q.index_select(0, plan.rows).view(len(plan.rows), num_kv_heads, -1, head_dim)
        args = (qd, pool[0], pool[1], plan.slots, plan.lens, scale)
        res = None
        if self.failed is None:
            try:
                if self._fn is None:
                    self._fn = torch.compile(dense_decode_attention, dynamic=True)
                res = self._fn(*args)
            except Exception as exc:  # noqa: BLE001  (no compiler, unsupported build, ...)
                self.failed = f"{type(exc).__name__}: {exc}"
                logger.warning("compiled decode attention failed, running it eagerly: %s", exc)
        if res is None:
            res = dense_decode_attention(*args)
        out.view(out.shape[0], -1).index_copy_(0, plan.rows, res.reshape(len(plan.rows), -1))
