"""Paged decode attention, flash-decoding style (torch reference:
:func:`decode_attention_reference`, which gathers the blocks and runs
``torch_attention.masked_attention``).

One query row per decoding sequence, K/V read straight from the blocks through ``block_table``::

    stage 1  grid (num_decode_seqs, num_kv_heads, num_splits)
             keys of a sequence split in ``num_splits`` ranges; a program holds the G query heads
             of one kv head (GQA) and writes a partial, already normalised output and its
             log-sum-exp (base 2) for its range (empty ranges write lse = -inf).
    stage 2  grid (num_decode_seqs, num_q_heads)
             combines the splits' partials with weights exp2(lse - max lse).

Keys are gathered token by token (``block_table[n // block_size]``), so any block size works.
A sliding window (``window``) splits only the last ``window`` keys of a sequence: the blocks
before them are never read. ``soft_cap`` caps the logits (``cap * tanh(s / cap)``). Both are
constants of a layer, passed as kernel arguments (a CUDA graph records them per launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blendkv.kernels.attention_mass import attention_with_mass
from blendkv.kernels.torch_attention import gather_kv, masked_attention
from blendkv.kernels.triton.attn_math import soft_cap as _soft_cap

LOG2E = 1.4426950408889634


@triton.jit
def _decode_stage1_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    decode_seq_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    window,
    cap_log2,
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
    num_splits,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CAP: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * group
    seq = tl.load(decode_seq_ptr + i)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    if USE_WINDOW:  # the last `window` keys only: the splits start at the window's first key
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    keys_per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(table + n // block_size, mask=n_mask, other=0).to(tl.int64)
        kv_off = block * stride_cb + (n % block_size) * stride_co + kv_head * stride_ch
        kv_mask = d_mask[:, None] & n_mask[None, :]
        k_t = tl.load(cache_ptr + kv_off[None, :] + d[:, None] * stride_cd, mask=kv_mask, other=0.0)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [G, N], base-2 logits
        if USE_CAP:
            s = _soft_cap(s, cap_log2)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(
            cache_ptr + stride_c2 + kv_off[:, None] + d[None, :] * stride_cd,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    row = (i * num_q_heads + heads).to(tl.int64) * num_splits + split  # [Nd, Hq, splits]
    tl.store(part_lse_ptr + row, lse, mask=g_mask)
    tl.store(
        part_out_ptr + row[:, None] * head_dim + d[None, :],
        out,
        mask=g_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _decode_stage2_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    decode_seq_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    row = (i * tl.num_programs(1) + head).to(tl.int64) * num_splits
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < head_dim
    lse = tl.load(part_lse_ptr + row + s, mask=s_mask, other=float("-inf"))
    # All splits empty only for a padding row (seq_len 0, e.g. a padded CUDA-graph batch):
    # weights 0, output 0 instead of NaN.
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(w, axis=0)
    w = w / tl.where(total > 0, total, 1.0)
    part = tl.load(
        part_out_ptr + (row + s)[:, None] * head_dim + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * part, axis=0)
    token = tl.load(query_start_loc_ptr + tl.load(decode_seq_ptr + i)).to(tl.int64)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def default_num_splits(max_seq_len: int) -> int:
    """Key splits per sequence: about one per 256 keys, a power of two, at most 16."""
    return min(16, triton.next_power_of_2(max(1, triton.cdiv(max_seq_len, 256))))


def decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    decode_seq_ids: torch.Tensor,
    scale: float,
    num_splits: int,
    window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """Attention of each decoding sequence's single row over its ``seq_lens[seq]`` keys (a
    sequence with ``seq_lens[seq] == 0``, a padding row, gets zeros); with ``window``, over
    its last ``window`` keys; ``soft_cap``: logits ``cap * tanh(s / cap)``.

    Args:
        out: [num_tokens, num_heads, head_dim]; row ``query_start_loc[seq]`` of each listed
            sequence is written, the others are left alone.
        q: [num_tokens, num_heads, head_dim].
        kv_cache: [2, num_blocks, block_size, kv_heads, head_dim] (this step's K/V written).
        block_table, seq_lens, query_start_loc: the step's metadata tensors.
        decode_seq_ids: [num_decode] int32, the sequences to compute (one query row each).
        num_splits: key ranges per sequence (:func:`default_num_splits`).
    """
    num_decode = decode_seq_ids.numel()
    if num_decode == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    part_out = torch.empty(
        num_decode, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(num_decode, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_stage1_kernel[(num_decode, num_kv_heads, num_splits)](
        q,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        decode_seq_ids,
        part_out,
        part_lse,
        scale * LOG2E,
        0 if window is None else int(window),
        1.0 if soft_cap is None else float(soft_cap) * LOG2E,
        *q.stride(),
        *kv_cache.stride(),
        block_table.stride(0),
        block_size,
        group,
        head_dim,
        num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=32,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        USE_WINDOW=window is not None,
        USE_CAP=soft_cap is not None,
    )
    _decode_stage2_kernel[(num_decode, num_heads)](
        out,
        part_out,
        part_lse,
        query_start_loc,
        decode_seq_ids,
        *out.stride(),
        head_dim,
        num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )


def decode_attention_reference(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    decode_seq_ids: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """Torch reference of :func:`decode_attention` (gather the blocks, masked SDPA; the dense
    oracle with a window or a soft cap)."""
    for seq in decode_seq_ids.tolist():
        row = int(query_start_loc[seq])
        seq_len = int(seq_lens[seq])
        keys, values = gather_kv(kv_cache, block_table[seq], seq_len)
        position = torch.tensor([seq_len - 1], device=q.device)
        if window is None and soft_cap is None:
            out[row : row + 1] = masked_attention(q[row : row + 1], keys, values, position, scale)
        else:
            out[row : row + 1], _ = attention_with_mass(
                q[row : row + 1],
                keys,
                values,
                position,
                scale=scale,
                window=window,
                soft_cap=soft_cap,
            )
