"""Decode rows of the torch backend on the CPU: in place over slices of the pool, or gathered.

A decode row (one new token) attends to every key of its sequence. Two ways, planned once per
step (:func:`decode_layout`) and run by every layer (:func:`decode_attention`):

- **In place.** The block manager places block tables in runs of consecutive block ids, so a
  row whose blocks lie in at most :data:`MAX_RUNS` runs reads each run as a slice of the pool:
  one flash call per run, the query heads of a KV head folded into its rows, runs merged by
  log-sum-exp. No copy of the keys. Needs the CPU flash op that returns the log-sum-exp.
- **Gathered.** Other rows go in groups of similar context length: one ``index_select`` per
  layer gathers every group's blocks, one padded, masked SDPA call per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blendkv.kernels.attention import AttentionMetadata
from blendkv.kernels.split_attention import flash_lse

DECODE_GROUP = 8  # gathered rows per padded SDPA call
# A decode row in more runs of consecutive blocks than this is gathered instead.
MAX_RUNS = 4


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token rows of similar context length, attended in one padded SDPA call."""

    lo: int  # rows [lo, hi) of the step's decode rows (in :attr:`DecodeLayout.rows` order)
    hi: int
    block_offset: int  # where this group's blocks start in the gathered blocks
    num_blocks: int  # blocks per row (the group's longest context)
    mask: torch.Tensor  # [rows, 1, 1, num_blocks * block_size] bool, True = a real key


@dataclass(frozen=True)
class DecodeLayout:
    rows: torch.Tensor  # [n] int64 token rows, sorted by context length
    block_ids: torch.Tensor  # every group's padded block table, flattened, K then V rows
    groups: list[DecodeGroup]
    # Rows attended in place (CPU): (token row, [(first pool slot, tokens) per run of the
    # row's blocks with consecutive ids]); they are not in ``rows``.
    in_place: list[tuple[int, list[tuple[int, int]]]]
    in_place_rows: torch.Tensor  # [len(in_place)] int64, their token rows


def decode_layout(
    md: AttentionMetadata,
    seqs: list[int],
    cache_shape: torch.Size,
    in_place: bool,
    max_runs: int = MAX_RUNS,
) -> DecodeLayout:
    """Decode rows whose blocks lie in at most ``max_runs`` runs of consecutive ids are
    attended in place (``in_place``: the CPU flash op is there). The others go in groups of
    similar context length: one padded SDPA call per group keeps the gathered K/V close to the
    real context sizes, and one ``index_select`` per layer gathers every group's blocks."""
    _, pool_blocks, block_size, _, _ = cache_shape
    dev = md.positions.device
    direct = []
    if in_place:
        gathered = []
        for i in seqs:
            runs = block_runs(md, i, block_size)
            if len(runs) <= max_runs:
                direct.append((md.query_start_loc_cpu[i], runs))
            else:
                gathered.append(i)
        seqs = gathered
    direct_rows = torch.tensor([row for row, _ in direct], dtype=torch.long, device=dev)
    if not seqs:
        empty = torch.empty(0, dtype=torch.long, device=dev)
        return DecodeLayout(empty, empty, [], direct, direct_rows)
    seqs = sorted(seqs, key=lambda i: md.seq_lens_cpu[i])
    groups, tables, offset = [], [], 0
    for g in range(0, len(seqs), DECODE_GROUP):
        members = seqs[g : g + DECODE_GROUP]
        lens = [md.seq_lens_cpu[i] for i in members]
        num_blocks = -(-max(lens) // block_size)
        idx = torch.tensor(members, dtype=torch.long, device=dev)
        tables.append(md.block_table[idx, :num_blocks].reshape(-1).long())
        keys = torch.arange(num_blocks * block_size, device=dev)
        mask = keys[None, :] < torch.tensor(lens, device=dev)[:, None]
        groups.append(DecodeGroup(g, g + len(members), offset, num_blocks, mask[:, None, None]))
        offset += len(members) * num_blocks
    flat = torch.cat(tables)
    rows = torch.tensor([md.query_start_loc_cpu[i] for i in seqs], dtype=torch.long, device=dev)
    return DecodeLayout(rows, torch.cat((flat, flat + pool_blocks)), groups, direct, direct_rows)


def block_runs(md: AttentionMetadata, i: int, block_size: int) -> list[tuple[int, int]]:
    """Sequence ``i``'s context as (first pool slot, tokens) per run of consecutive blocks."""
    seq_len = md.seq_lens_cpu[i]
    table = md.block_table[i, : -(-seq_len // block_size)].tolist()
    runs: list[tuple[int, int]] = []
    first = prev = table[0]
    for b in table[1:]:
        if b != prev + 1:
            runs.append((first * block_size, (prev - first + 1) * block_size))
            first = b
        prev = b
    last = (first * block_size, (prev - first + 1) * block_size)
    runs.append((last[0], last[1] - (len(table) * block_size - seq_len)))
    return runs


def in_place_decode(q, kv_cache, layout: DecodeLayout, out, scale) -> None:
    """Decode rows over slices of the pool (no gather): one flash call per run of consecutive
    blocks, the query heads of a KV head folded into its rows, runs merged by log-sum-exp."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    pool = kv_cache.view(2, -1, num_kv_heads, head_dim).transpose(1, 2)  # [2, Hkv, slots, D]
    keys, values = pool[0][None], pool[1][None]
    qf = q.reshape(q.shape[0], 1, num_kv_heads, -1, head_dim)
    outs = []
    for row, runs in layout.in_place:
        parts = [
            flash_lse(qf[row], keys.narrow(2, s, n), values.narrow(2, s, n), scale, None)
            for s, n in runs
        ]
        if len(parts) == 1:
            outs.append(parts[0][0])
        else:
            lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
            merged = sum(p[0] * torch.exp(p[1] - lse)[..., None] for p in parts)
            outs.append(merged.to(out.dtype))  # the log-sum-exps are fp32
    flat = out.view(out.shape[0], -1)
    flat.index_copy_(0, layout.in_place_rows, torch.cat(outs).view(len(outs), -1))


def decode_attention(q, kv_cache, layout: DecodeLayout, out, scale) -> None:
    """Every single-token row: pad each group's contexts to its longest one and mask."""
    if layout.in_place:
        in_place_decode(q, kv_cache, layout, out, scale)
    if not layout.groups:
        return
    _, pool_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    picked = kv_cache.view(2 * pool_blocks, -1).index_select(0, layout.block_ids)
    picked = picked.view(2, -1, block_size, num_kv_heads, head_dim)
    qd = q.index_select(0, layout.rows)  # [n, Hq, D]
    # The query heads sharing a KV head go in as that head's "query rows" (all see the same
    # keys): SDPA then reads each KV head once instead of once per query head.
    qd = qd.view(qd.shape[0], num_kv_heads, -1, head_dim)  # [n, Hkv, Hq / Hkv, D]
    res = torch.empty_like(qd)
    for g in layout.groups:
        n = g.hi - g.lo
        kv = picked[:, g.block_offset : g.block_offset + n * g.num_blocks]
        kv = kv.reshape(2, n, g.num_blocks * block_size, num_kv_heads, head_dim).transpose(2, 3)
        res[g.lo : g.hi] = F.scaled_dot_product_attention(
            qd[g.lo : g.hi], kv[0], kv[1], attn_mask=g.mask, scale=scale
        )
    out.view(out.shape[0], -1).index_copy_(0, layout.rows, res.view(res.shape[0], -1))
