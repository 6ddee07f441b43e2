"""Paged attention for query rows at arbitrary absolute positions (torch reference:
:func:`prefill_attention_reference`, which gathers the blocks and runs
``torch_attention.masked_attention``).

A row at position ``p`` of sequence ``s`` sees the keys of ``s`` at positions ``<= p``, read from
the blocks through ``block_table``: chunked prefill, prefix-cache hits, CacheBlend's scattered
recomputed rows and decode rows are all the same case. Grid and tiles::

    grid (num_tiles, num_kv_heads)
    tile = up to BLOCK_Q consecutive rows of one sequence (rows of a sequence ascend in position)
    a program holds BLOCK_M = BLOCK_Q * G (row, q-head) pairs of one kv head (GQA), and loops
    over key tiles of BLOCK_N up to the tile's last row position (keys past it are skipped),
    online softmax in float32.

``tile_seq_ids`` / ``tile_starts`` (which sequence, first row) are built on the host from the
metadata's Python mirrors (:mod:`~blendkv.kernels.triton.prefill_tiles`' ``build_tiles``), so
a launch needs no device-to-host sync.

A sliding window (``window``: a row at ``p`` sees keys ``p - window < j <= p``) starts a tile's
key loop at its first row's first key (the keys before every row's window are not read);
``soft_cap`` caps the logits. Fresh prefills on such a layer go through this kernel too.

Few tiles over long keys (a reuse's or ProphetKV's query rows over thousands of chunk tokens)
would leave most of a GPU idle, each program walking every key alone. With ``num_splits > 1``
the key range of each tile is cut in ``num_splits`` parts, flash-decoding style::

    stage 1  grid (num_tiles, num_kv_heads, num_splits): each part's normalised output and
             log-sum-exp (base 2) per (row, head), into a float32 scratch buffer
    stage 2  grid (num_tiles, num_kv_heads): the parts combined with weights exp2(lse - max)

``prefill_tiles.prefill_num_splits`` picks the count from host-known sizes (no sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blendkv.kernels.attention_mass import attention_with_mass
from blendkv.kernels.torch_attention import gather_kv, masked_attention
from blendkv.kernels.triton.attn_math import soft_cap as _soft_cap
from blendkv.kernels.triton.prefill_tiles import DEFAULT_TILES, PrefillTiles

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    positions_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    part_out_ptr,
    part_lse_ptr,
    lse_ptr,
    num_splits,
    qk_scale,
    window,
    cap_log2,
    stride_lt,
    stride_ot,
    stride_oh,
    stride_od,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_c2,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    stride_bt,
    block_size,
    group,
    head_dim,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CAP: tl.constexpr,
    SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_start_ptr + tile)
    seq_end = tl.load(query_start_loc_ptr + seq + 1)
    last = tl.minimum(first + BLOCK_Q, seq_end) - 1
    # Rows ascend in position, so the last row bounds every key the tile can see.
    key_end = tl.minimum(tl.load(positions_ptr + last) + 1, tl.load(seq_lens_ptr + seq))

    r = tl.arange(0, BLOCK_M)
    token = first + r // group
    head = kv_head * group + r % group
    r_mask = (r // group < BLOCK_Q) & (token < seq_end)
    token = token.to(tl.int64)
    # Padding rows see key 0 only: finite softmax, never stored.
    pos = tl.load(positions_ptr + token, mask=r_mask, other=0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    if USE_WINDOW:  # from the first row's first key: the keys before every window are unread
        key_start = tl.maximum(tl.load(positions_ptr + first) - window + 1, 0)
    else:
        key_start = 0
    if SPLIT:  # this program's part of the tile's keys (whole BLOCK_N tiles; may be empty)
        per_split = tl.cdiv(tl.cdiv(key_end - key_start, num_splits), BLOCK_N) * BLOCK_N
        key_start = key_start + tl.program_id(2) * per_split
        key_end = tl.minimum(key_start + per_split, key_end)
    for n0 in range(key_start, key_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < key_end
        block = tl.load(table + n // block_size, mask=n_mask, other=0).to(tl.int64)
        kv_off = block * stride_cb + (n % block_size) * stride_co + kv_head * stride_ch
        k_t = tl.load(
            cache_ptr + kv_off[None, :] + d[:, None] * stride_cd,
            mask=d_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # base-2 logits
        if USE_CAP:
            s = _soft_cap(s, cap_log2)
        visible = (n[None, :] <= pos[:, None]) & n_mask[None, :]
        if USE_WINDOW:
            visible = visible & (n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # Key 0 is in the first tile and visible to every row, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if USE_WINDOW:  # not so with a window: a row may see no key of a tile yet
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        if SPLIT:  # nor in a later part: a row sees none of its keys before its position
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        v = tl.load(
            cache_ptr + stride_c2 + kv_off[:, None] + d[None, :] * stride_cd,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    if SPLIT:  # a part: its output and log-sum-exp (-inf: it saw no key), combined later
        part = (tile * tl.num_programs(1) + kv_head) * num_splits + tl.program_id(2)
        row = part.to(tl.int64) * BLOCK_M + r
        seen = l_i > 0
        lse = m_i + tl.log2(tl.where(seen, l_i, 1.0))
        tl.store(part_lse_ptr + row, tl.where(seen, lse, float("-inf")))
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], out)
    else:
        if USE_WINDOW:  # padding rows (never stored) may have seen no key
            l_i = tl.where(l_i > 0, l_i, 1.0)
        if WRITE_LSE:
            tl.store(lse_ptr + token * stride_lt + head, m_i + tl.log2(l_i), mask=r_mask)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr
            + token[:, None] * stride_ot
            + head[:, None] * stride_oh
            + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=r_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _prefill_combine_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    lse_ptr,
    query_start_loc_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    num_splits,
    stride_lt,
    stride_ot,
    stride_oh,
    stride_od,
    group,
    head_dim,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_start_ptr + tile)
    seq_end = tl.load(query_start_loc_ptr + seq + 1)
    r = tl.arange(0, BLOCK_M)
    token = (first + r // group).to(tl.int64)
    head = kv_head * group + r % group
    r_mask = (r // group < BLOCK_Q) & (token < seq_end)
    d = tl.arange(0, BLOCK_D)
    base = (tile * tl.num_programs(1) + kv_head).to(tl.int64) * num_splits * BLOCK_M + r
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for i in range(num_splits):
        m = tl.maximum(m, tl.load(part_lse_ptr + base + i * BLOCK_M))
    m = tl.where(m == float("-inf"), 0.0, m)  # a padding row: no part saw a key
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for i in range(num_splits):
        w = tl.exp2(tl.load(part_lse_ptr + base + i * BLOCK_M) - m)
        part = tl.load(part_out_ptr + (base + i * BLOCK_M)[:, None] * BLOCK_D + d[None, :])
        acc += w[:, None] * part
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    if WRITE_LSE:
        lse = m + tl.log2(tl.where(total > 0, total, 1.0))
        tl.store(lse_ptr + token * stride_lt + head, lse, mask=r_mask)
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & (d[None, :] < head_dim),
    )


def prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    tile_seq_ids: torch.Tensor,
    tile_starts: torch.Tensor,
    block_q: int,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int = 1,
    tiles: PrefillTiles = DEFAULT_TILES,
    lse: torch.Tensor | None = None,
) -> None:
    """Attention of the rows covered by the tiles (:func:`build_tiles`) over the paged cache;
    ``window``/``soft_cap``: the layer's sliding window and logit cap (None: none);
    ``num_splits``: key parts per tile (:func:`prefill_num_splits`), combined in a second launch;
    ``tiles``: key tile and launch settings (its ``block_m`` is the one ``block_q`` came from);
    ``lse``: float32 [num_tokens, num_heads] that also gets each covered (row, head)'s base-2
    log-sum-exp of its scaled (and capped) logits, ``log2(sum(2 ** s))`` with
    ``s = q.k * scale * log2(e)`` (ProphetKV's query mass reads it).

    Args:
        out: [num_tokens, num_heads, head_dim]; only rows covered by a tile are written.
        q: [num_tokens, num_heads, head_dim].
        kv_cache: [2, num_blocks, block_size, kv_heads, head_dim] (this step's K/V written).
        block_table, seq_lens, query_start_loc, positions: the step's metadata tensors;
            ``positions`` must ascend within each sequence.
        block_q: rows per tile, as passed to :func:`build_tiles`.
    """
    num_tiles = tile_seq_ids.numel()
    if num_tiles == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_out = part_lse = out  # (unused without splits)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:2] and lse.stride(1) == 1
    if num_splits > 1:
        parts = num_tiles * num_kv_heads * num_splits * block_m
        part_out = torch.empty(parts, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(parts, dtype=torch.float32, device=q.device)
    _prefill_kernel[(num_tiles, num_kv_heads, num_splits)](
        out,
        q,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        positions,
        tile_seq_ids,
        tile_starts,
        part_out,
        part_lse,
        out if lse is None else lse,
        num_splits,
        scale * LOG2E,
        0 if window is None else int(window),
        1.0 if soft_cap is None else float(soft_cap) * LOG2E,
        0 if lse is None else lse.stride(0),
        *out.stride(),
        *q.stride(),
        *kv_cache.stride(),
        block_table.stride(0),
        block_size,
        group,
        head_dim,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        USE_WINDOW=window is not None,
        USE_CAP=soft_cap is not None,
        SPLIT=num_splits > 1,
        WRITE_LSE=lse is not None and num_splits == 1,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _prefill_combine_kernel[(num_tiles, num_kv_heads)](
            out,
            part_out,
            part_lse,
            out if lse is None else lse,
            query_start_loc,
            tile_seq_ids,
            tile_starts,
            num_splits,
            0 if lse is None else lse.stride(0),
            *out.stride(),
            group,
            head_dim,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            WRITE_LSE=lse is not None,
        )


def prefill_attention_reference(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_cpu: list[int],
    query_start_loc_cpu: list[int],
    positions: torch.Tensor,
    seq_ids: list[int],
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """Torch reference of :func:`prefill_attention` for the rows of ``seq_ids``."""
    for seq in seq_ids:
        lo, hi = query_start_loc_cpu[seq], query_start_loc_cpu[seq + 1]
        if hi == lo:
            continue
        keys, values = gather_kv(kv_cache, block_table[seq], seq_lens_cpu[seq])
        if window is None and soft_cap is None:
            out[lo:hi] = masked_attention(q[lo:hi], keys, values, positions[lo:hi], scale)
        else:
            out[lo:hi], _ = attention_with_mass(
                q[lo:hi],
                keys,
                values,
                positions[lo:hi],
                scale=scale,
                window=window,
                soft_cap=soft_cap,
            )
