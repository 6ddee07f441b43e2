"""ProphetKV's per-layer score: the softmax attention the query rows pay each key, summed over
rows and heads, read straight from the paged pool (torch reference:
:func:`query_mass_reference`, i.e. :func:`~blendkv.kernels.attention_mass.query_attention_mass`
over the keys gathered from their slots).

The torch version gathers a float32 copy of every key of the sequence and runs ~12 kernels a
layer; here it is two launches and no copy, one where attention left its log-sum-exp:

1. ``_lse_kernel``, grid ``(kv_heads, row blocks)``: each (query row, head)'s log-sum-exp over the
   keys it sees (key ``j`` sits at position ``j``; a row at position ``p`` sees ``j <= p``), the
   online-softmax loop of flash attention without values. Skipped when the layer's attention
   wrote it (``lse``: the query pass's layers, ``prefill_attention(lse=...)``).
2. ``_mass_kernel``, grid ``(key blocks,)``: for its keys, ``exp(q.k * scale - lse)`` summed over
   every row and head, added to the scores. Each key belongs to one program: no atomics, so
   the sums (and the rows ProphetKV picks from them) are the same on every run.

On a sliding-window layer a row sees only keys ``p - window < j <= p``; a soft cap caps the
logits (``cap * tanh(s / cap)``), both as the layer's attention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blendkv.kernels.attention_mass import query_attention_mass
from blendkv.kernels.triton.attn_math import soft_cap as _soft_cap

LOG2E = 1.4426950408889634


@triton.jit
def _load_q(q_ptr, m, num_q, group, kvh, stride_qt, stride_qh, d, head_dim, rows):
    """Rows ``m`` of one KV head's query block, g-major: row ``m`` is query ``m % num_q`` of
    head ``kvh * group + m // num_q``."""
    row_ok = m < rows
    i = m % num_q
    head = kvh * group + m // num_q
    ptrs = q_ptr + i[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(ptrs, mask=row_ok[:, None] & (d[None, :] < head_dim), other=0.0)
    return q, i, row_ok


@triton.jit
def _load_k(
    cache_ptr, slots_ptr, n, key_ok, kvh, stride_cb, stride_co, stride_ch, block_size, d, head_dim
):
    """Keys ``n`` of KV head ``kvh`` from the pool, transposed: [BLOCK_D, BLOCK_N]."""
    slot = tl.load(slots_ptr + n, mask=key_ok, other=0).to(tl.int64)
    ptrs = (
        cache_ptr
        + (slot // block_size)[None, :] * stride_cb
        + (slot % block_size)[None, :] * stride_co
        + kvh * stride_ch
        + d[:, None]
    )
    return tl.load(ptrs, mask=key_ok[None, :] & (d[:, None] < head_dim), other=0.0)


@triton.jit
def _lse_kernel(
    q_ptr,
    qpos_ptr,
    cache_ptr,
    slots_ptr,
    lse_ptr,
    scale_log2,
    window,
    cap_log2,
    num_q,
    num_keys,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    group,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CAP: tl.constexpr,
    SPLIT: tl.constexpr,
):
    kvh = tl.program_id(0)
    rows = group * num_q
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q, i, row_ok = _load_q(q_ptr, m, num_q, group, kvh, stride_qt, stride_qh, d, head_dim, rows)
    qpos = tl.load(qpos_ptr + i, mask=row_ok, other=0)  # every row sees key 0: no empty row
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    last = tl.max(tl.where(row_ok, qpos, 0), axis=0)  # keys past the block's last row: unseen
    lo, hi = 0, tl.minimum(num_keys, last + 1)
    if SPLIT:  # this program's part of the keys (whole BLOCK_N blocks; may be empty)
        per_split = tl.cdiv(tl.cdiv(hi, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = tl.program_id(2) * per_split
        hi = tl.minimum(lo + per_split, hi)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = n < num_keys
        k = _load_k(
            cache_ptr,
            slots_ptr,
            n,
            key_ok,
            kvh,
            stride_cb,
            stride_co,
            stride_ch,
            block_size,
            d,
            head_dim,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if USE_CAP:
            s = _soft_cap(s, cap_log2)
        seen = key_ok[None, :] & (n[None, :] <= qpos[:, None])
        if USE_WINDOW:
            seen = seen & (n[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row may see no key of a block (a window, a part) or none at all (position -1: a
        # row a captured pass scores for nothing)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m_i = m_new
    seen_any = l_i > 0  # only in a part or at position -1: every other row sees key 0
    lse = tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
    part = tl.program_id(2) * tl.num_programs(0) + kvh
    tl.store(lse_ptr + part * rows + m, lse, mask=row_ok)


@triton.jit
def _row_lse(lse_ptr, kvh, num_kv_heads, rows, m, row_ok, num_splits):
    """A row block's log-sum-exp (base 2) from its ``num_splits`` parts (one: as is)."""
    top = tl.full(m.shape, float("-inf"), tl.float32)
    for part in range(num_splits):
        at = lse_ptr + (part * num_kv_heads + kvh) * rows + m
        top = tl.maximum(top, tl.load(at, mask=row_ok, other=0.0))
    top = tl.where(top == float("-inf"), 0.0, top)  # a row that sees no key (position -1)
    total = tl.zeros(m.shape, tl.float32)
    for part in range(num_splits):
        at = lse_ptr + (part * num_kv_heads + kvh) * rows + m
        total += tl.exp2(tl.load(at, mask=row_ok, other=0.0) - top)
    return tl.where(total > 0, top + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))


@triton.jit
def _mass_kernel(
    q_ptr,
    qpos_ptr,
    cache_ptr,
    slots_ptr,
    lse_ptr,
    out_ptr,
    scale_log2,
    window,
    cap_log2,
    num_q,
    num_keys,
    key_count_ptr,
    num_kv_heads,
    num_splits,
    stride_lt,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    group,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CAP: tl.constexpr,
    ROW_LSE: tl.constexpr,
    KEY_COUNT: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    n = start_n + tl.arange(0, BLOCK_N)
    if KEY_COUNT:  # the sequence's real key count, on the device (a captured pass)
        num_keys = tl.minimum(num_keys, tl.load(key_count_ptr))
    key_ok = n < num_keys
    d = tl.arange(0, BLOCK_D)
    rows = group * num_q
    acc = tl.zeros([BLOCK_N], tl.float32)
    heads = tl.where(start_n < num_keys, num_kv_heads, 0)  # a block past the keys: nothing
    for kvh in range(0, heads):
        k = _load_k(
            cache_ptr,
            slots_ptr,
            n,
            key_ok,
            kvh,
            stride_cb,
            stride_co,
            stride_ch,
            block_size,
            d,
            head_dim,
        )
        for start in range(0, rows, BLOCK_M):
            m = start + tl.arange(0, BLOCK_M)
            q, i, row_ok = _load_q(
                q_ptr, m, num_q, group, kvh, stride_qt, stride_qh, d, head_dim, rows
            )
            qpos = tl.load(qpos_ptr + i, mask=row_ok, other=-1)
            if ROW_LSE:  # attention's: [query row, head]
                head = kvh * group + m // num_q
                lse = tl.load(lse_ptr + i * stride_lt + head, mask=row_ok, other=0.0)
            else:
                lse = _row_lse(lse_ptr, kvh, num_kv_heads, rows, m, row_ok, num_splits)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
            if USE_CAP:
                s = _soft_cap(s, cap_log2)
            seen = row_ok[:, None] & key_ok[None, :] & (n[None, :] <= qpos[:, None])
            if USE_WINDOW:
                seen = seen & (n[None, :] > qpos[:, None] - window)
            acc += tl.sum(tl.where(seen, tl.exp2(s - lse[:, None]), 0.0), axis=0)
    old = tl.load(out_ptr + n, mask=key_ok, other=0.0)
    tl.store(out_ptr + n, old + acc, mask=key_ok)


def add_query_mass(
    scores: torch.Tensor,
    q: torch.Tensor,
    q_positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    target_programs: int = 264,
    lse: torch.Tensor | None = None,
    key_count: torch.Tensor | None = None,
) -> None:
    """``scores`` [S] float32 += the attention mass of ``q`` [Q, H, D] (RoPE applied, at
    ``q_positions`` [Q]) over the keys of positions ``0..S-1``, at ``slots`` [S] of ``kv_cache``
    [2, num_blocks, block_size, kv_heads, head_dim] (the query rows' own K written).
    ``scale`` (None: ``head_dim ** -0.5``), ``window``, ``soft_cap``: the layer's.
    ``target_programs``: the log-sum-exp pass cuts the keys in parts while it has fewer
    programs than this (:func:`~blendkv.kernels.triton.prefill_tiles.prefill_num_splits`;
    about twice the GPU's multiprocessors); the mass pass combines the parts.
    ``lse``: float32 [Q, H], each row and head's base-2 log-sum-exp as the layer's attention
    computed it (``prefill_attention(lse=...)``): the log-sum-exp pass is skipped (one launch).
    ``key_count``: int32 [1] on the device, the keys past it score nothing and cost nothing
    (a captured pass sized for the longest sequence; no query row sees them anyway)."""
    from blendkv.kernels.triton.prefill_tiles import prefill_num_splits

    num_q, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_keys = slots.numel()
    assert kv_cache.stride(-1) == 1
    assert scores.shape == (num_keys,) and scores.dtype == torch.float32 and q.stride(2) == 1
    if num_q == 0 or num_keys == 0:
        return
    group = num_heads // num_kv_heads
    rows = group * num_q
    block_m, block_n = 32, 64
    block_d = max(16, triton.next_power_of_2(head_dim))
    row_blocks = triton.cdiv(rows, block_m)
    k_cache = kv_cache[0]
    # the reference's scale (head_dim ** -0.5) unless the layer has its own
    scale_log2 = (head_dim**-0.5 if scale is None else scale) * LOG2E
    precision = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    common = (*q.stride()[:2], *k_cache.stride()[:3], block_size, group, head_dim)
    layer = (
        0 if window is None else int(window),
        1.0 if soft_cap is None else float(soft_cap) * LOG2E,
    )
    flags = {"USE_WINDOW": window is not None, "USE_CAP": soft_cap is not None}
    splits = lse_stride = 0
    if lse is None:
        splits = prefill_num_splits(row_blocks, num_kv_heads, num_keys, target_programs)
        lse = torch.empty(splits * num_kv_heads * rows, dtype=torch.float32, device=q.device)
        _lse_kernel[(num_kv_heads, row_blocks, splits)](
            q,
            q_positions,
            k_cache,
            slots,
            lse,
            scale_log2,
            *layer,
            num_q,
            num_keys,
            *common,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            DOT_PRECISION=precision,
            SPLIT=splits > 1,
            **flags,
        )
    else:
        assert lse.dtype == torch.float32 and lse.shape == (num_q, num_heads)
        assert lse.stride(1) == 1
        lse_stride = lse.stride(0)
    _mass_kernel[(triton.cdiv(num_keys, block_n),)](
        q,
        q_positions,
        k_cache,
        slots,
        lse,
        scores,
        scale_log2,
        *layer,
        num_q,
        num_keys,
        slots if key_count is None else key_count,
        num_kv_heads,
        splits,
        lse_stride,
        *common,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=precision,
        ROW_LSE=splits == 0,
        KEY_COUNT=key_count is not None,
        **flags,
    )


def query_mass_reference(scores, q, q_positions, kv_cache, slots) -> None:
    """The torch computation the kernels replace (float32)."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    keys = kv_cache[0].reshape(-1, num_kv_heads, head_dim).index_select(0, slots)
    key_positions = torch.arange(len(slots), device=slots.device)
    scores += query_attention_mass(q, keys, q_positions, key_positions)
