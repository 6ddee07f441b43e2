"""The K/V correction of a blended layer in two launches (torch reference:
:func:`blendkv.blend.correction.correct_kept_rows`, ~30 kernels a layer).

A chunk's reused rows that are not recomputed are moved by the mean deviation of its recomputed
rows (fresh minus reused, K compared before RoPE), shrunk by ``n / (n + shrink)``:

1. ``_shift_kernel``, grid ``(chunks, kv_heads)``: the recomputed rows of a chunk are one run
   (rows are in position order, chunks too), ``segments[c] .. segments[c + 1]``; the program
   sums their deviation (the reused K read from the pool with RoPE undone) and writes the
   chunk's shift, float32 ``[2, chunks, kv_heads, head_dim]`` (K, V). Plain sums in row order:
   no atomics, the same bits every run.
2. ``_apply_kernel``, grid ``(kept rows,)``: each kept row's K gets its chunk's K shift rotated
   to the row's position (RoPE is linear), its V the V shift, in place in the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shift_kernel(
    k_ptr,
    v_ptr,
    rows_ptr,
    slots_ptr,
    pos_ptr,
    seg_ptr,
    cache_ptr,
    cos_ptr,
    sin_ptr,
    shift_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c2,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    num_chunks,
    num_kv_heads,
    head_dim,
    inv_scale_sq,
    shrink,
    DO_K: tl.constexpr,
    DO_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.load(seg_ptr + c)
    hi = tl.load(seg_ptr + c + 1)
    d = tl.arange(0, BLOCK_D)[None, :]
    half = head_dim // 2
    dmask = d < head_dim
    partner = tl.where(d < half, d + half, d - half)
    sum_k = tl.zeros([BLOCK_D], tl.float32)
    sum_v = tl.zeros([BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)[:, None]
        ok = (r < hi) & dmask
        row = tl.load(rows_ptr + r, mask=r < hi, other=0).to(tl.int64)
        slot = tl.load(slots_ptr + r, mask=r < hi, other=0).to(tl.int64)
        old = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_co
        old += h * stride_ch
        if DO_K:
            pos = tl.load(pos_ptr + r, mask=r < hi, other=0).to(tl.int64)
            cos = tl.load(cos_ptr + pos * head_dim + d, mask=ok, other=0.0)
            sin = tl.load(sin_ptr + pos * head_dim + d, mask=ok, other=0.0)
            x = tl.load(old + d, mask=ok, other=0.0).to(tl.float32)
            xp = tl.load(old + partner, mask=ok, other=0.0).to(tl.float32)
            # inverse RoPE: x * cos - rotate_half(x) * sin, over the scaling squared
            rot = tl.where(d < half, -xp, xp)
            reused = (x * cos - rot * sin) * inv_scale_sq
            fresh = tl.load(k_ptr + row * stride_kt + h * stride_kh + d, mask=ok, other=0.0)
            sum_k += tl.sum(tl.where(ok, fresh.to(tl.float32) - reused, 0.0), axis=0)
        if DO_V:
            reused_v = tl.load(old + stride_c2 + d, mask=ok, other=0.0).to(tl.float32)
            fresh_v = tl.load(v_ptr + row * stride_vt + h * stride_vh + d, mask=ok, other=0.0)
            sum_v += tl.sum(tl.where(ok, fresh_v.to(tl.float32) - reused_v, 0.0), axis=0)
    weight = 1.0 / tl.maximum((hi - lo).to(tl.float32) + shrink, 1e-12)
    dd = tl.arange(0, BLOCK_D)
    out = shift_ptr + (c * num_kv_heads + h) * head_dim + dd
    if DO_K:
        tl.store(out, sum_k * weight, mask=dd < head_dim)
    if DO_V:
        tl.store(out + num_chunks * num_kv_heads * head_dim, sum_v * weight, mask=dd < head_dim)


@triton.jit
def _apply_kernel(
    slots_ptr,
    pos_ptr,
    chunk_ptr,
    cache_ptr,
    cos_ptr,
    sin_ptr,
    shift_ptr,
    stride_c2,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    num_chunks,
    num_kv_heads,
    head_dim,
    DO_K: tl.constexpr,
    DO_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    chunk = tl.load(chunk_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_co
    dst += h * stride_ch + d
    src = shift_ptr + (chunk * num_kv_heads + h) * head_dim
    dt = cache_ptr.dtype.element_ty
    if DO_K:
        half = head_dim // 2
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * head_dim + d, mask=d < head_dim, other=0.0)
        sin = tl.load(sin_ptr + pos * head_dim + d, mask=d < head_dim, other=0.0)
        s = tl.load(src + d, mask=mask, other=0.0)
        sp = tl.load(src + tl.where(d < half, d + half, d - half), mask=mask, other=0.0)
        moved = s * cos + tl.where(d < half, -sp, sp) * sin
        cur = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, (moved + cur).to(dt), mask=mask)
    if DO_V:
        s = tl.load(src + num_chunks * num_kv_heads * head_dim + d, mask=mask, other=0.0)
        cur = tl.load(dst + stride_c2, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + stride_c2, (s + cur).to(dt), mask=mask)


def shift_kept_rows(
    kv_cache: torch.Tensor,
    which: str,
    shrink: float,
    k: torch.Tensor,
    v: torch.Tensor,
    recomputed,
    kept,
    num_chunks: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention_scaling: float,
) -> None:
    """Shift ``kept`` rows' K and/or V (``which``: ``k``, ``v``, ``kv``) in ``kv_cache``.

    ``k`` (pre-RoPE) / ``v`` [T, Hkv, D]: the layer's fresh rows; ``recomputed`` rows
    (:class:`~blendkv.blend.correction.Rows` with ``rows`` into ``k``/``v`` and ``segments``,
    the run of each chunk) still hold the reused K/V in the pool. ``cos`` / ``sin``: the float32
    RoPE tables [max_position, D]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert kv_cache.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    do_k, do_v = "k" in which, "v" in which
    shift = torch.empty(2, num_chunks, num_kv_heads, head_dim, dtype=torch.float32,
                        device=kv_cache.device)  # fmt: skip
    block_d = triton.next_power_of_2(head_dim)
    cache_strides = kv_cache.stride()[:4]
    _shift_kernel[(num_chunks, num_kv_heads)](
        k, v, recomputed.rows, recomputed.slots, recomputed.positions, recomputed.segments,
        kv_cache, cos, sin, shift, *k.stride()[:2], *v.stride()[:2], *cache_strides,
        block_size, num_chunks, num_kv_heads, head_dim, 1.0 / attention_scaling**2,
        float(shrink), DO_K=do_k, DO_V=do_v, BLOCK_R=16, BLOCK_D=block_d,
    )  # fmt: skip
    _apply_kernel[(len(kept.slots),)](
        kept.slots, kept.positions, kept.chunk_ids, kv_cache, cos, sin, shift, *cache_strides,
        block_size, num_chunks, num_kv_heads, head_dim, DO_K=do_k, DO_V=do_v,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=block_d,
    )  # fmt: skip
