"""The K/V correction of a blended layer in one launch, two with the pooled prior (torch
reference: :func:`blendkv.blend.correction.correct_kept_rows`, ~30 kernels a layer).

A chunk's reused rows that are not recomputed are moved by the mean deviation of its recomputed
rows (fresh minus reused, K compared before RoPE), shrunk with a pseudo-count towards a prior:
``(sum + shrink * prior) / (n + shrink)``, the prior the sum over all the recomputed rows over
their number + shrink (``pooled``) or 0. Rows are in position order and chunks too, so a
chunk's recomputed rows are one run (``segments[c] .. segments[c + 1]``) and so are its kept
rows (``kept_segments``).

``_shift_kernel``, grid ``(chunks, kv_heads, parts)``: each program sums its chunk's deviation
over the recomputed rows (the reused K read from the pool with RoPE undone), in row order (no
atomics: the same bits every run and in every part), and adds the shift (K rotated to each
row's position: RoPE is linear) to its part of the chunk's kept rows, in place in the pool. The
parts split a chunk's kept rows so the launch fills the device; each recomputes the chunk's sum
(a few dozen rows) rather than wait for another program's. The pooled prior needs every chunk's
sum first: ``_sums_kernel``, grid ``(chunks, kv_heads)``, writes them to a small float32 buffer,
and the shift programs read them there (their own and, added in chunk order, all of them).

K is handled in its two RoPE halves (``rotate_half`` pairs ``d`` with ``d + D/2``), so no value
is read twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, pos, head_dim, half, a, ok):
    """RoPE's cos and sin at rows' positions, first half (dims ``a``) then second."""
    at = pos * head_dim + a
    cos_a = tl.load(cos_ptr + at, mask=ok, other=0.0)
    sin_a = tl.load(sin_ptr + at, mask=ok, other=0.0)
    cos_b = tl.load(cos_ptr + at + half, mask=ok, other=0.0)
    sin_b = tl.load(sin_ptr + at + half, mask=ok, other=0.0)
    return cos_a, sin_a, cos_b, sin_b


@triton.jit
def _slot_head(cache_ptr, slots_ptr, r, n_end, block_size, stride_cb, stride_co, h, stride_ch):
    """Where rows ``r`` (< ``n_end``; their pool slots at ``slots_ptr``) keep KV head ``h``'s K
    in the pool (V: + the pool's first stride)."""
    slot = tl.load(slots_ptr + r, mask=r < n_end, other=0).to(tl.int64)
    at = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_co
    return at + h * stride_ch


@triton.jit
def _deviation_sums(
    k_ptr,
    v_ptr,
    rows_ptr,
    slots_ptr,
    pos_ptr,
    lo,
    hi,
    cache_ptr,
    cos_ptr,
    sin_ptr,
    h,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c2,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    half,
    head_dim,
    inv_scale_sq,
    DO_K: tl.constexpr,
    DO_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Sums of (fresh - reused) over recomputed rows ``lo .. hi`` for KV head ``h``: K's and V's,
    each as its two RoPE halves (zeros for a half not asked for)."""
    a = tl.arange(0, BLOCK_HALF)[None, :]  # the first half's dims; b = a + half
    amask = a < half
    sum_ka = tl.zeros([BLOCK_HALF], tl.float32)
    sum_kb = tl.zeros([BLOCK_HALF], tl.float32)
    sum_va = tl.zeros([BLOCK_HALF], tl.float32)
    sum_vb = tl.zeros([BLOCK_HALF], tl.float32)
    for start in range(lo, hi, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)[:, None]
        ok = (r < hi) & amask
        row = tl.load(rows_ptr + r, mask=r < hi, other=0).to(tl.int64)
        old = _slot_head(
            cache_ptr, slots_ptr, r, hi, block_size, stride_cb, stride_co, h, stride_ch
        )
        if DO_K:
            pos = tl.load(pos_ptr + r, mask=r < hi, other=0).to(tl.int64)
            cos_a, sin_a, cos_b, sin_b = _cos_sin(cos_ptr, sin_ptr, pos, head_dim, half, a, ok)
            xa = tl.load(old + a, mask=ok, other=0.0).to(tl.float32)
            xb = tl.load(old + half + a, mask=ok, other=0.0).to(tl.float32)
            # inverse RoPE, x * cos - rotate_half(x) * sin, over the scaling squared
            reused_a = (xa * cos_a + xb * sin_a) * inv_scale_sq
            reused_b = (xb * cos_b - xa * sin_b) * inv_scale_sq
            fresh = k_ptr + row * stride_kt + h * stride_kh
            fa = tl.load(fresh + a, mask=ok, other=0.0).to(tl.float32)
            fb = tl.load(fresh + half + a, mask=ok, other=0.0).to(tl.float32)
            sum_ka += tl.sum(tl.where(ok, fa - reused_a, 0.0), axis=0)
            sum_kb += tl.sum(tl.where(ok, fb - reused_b, 0.0), axis=0)
        if DO_V:
            fresh = v_ptr + row * stride_vt + h * stride_vh
            va = tl.load(fresh + a, mask=ok, other=0.0).to(tl.float32)
            vb = tl.load(fresh + half + a, mask=ok, other=0.0).to(tl.float32)
            ra = tl.load(old + stride_c2 + a, mask=ok, other=0.0).to(tl.float32)
            rb = tl.load(old + stride_c2 + half + a, mask=ok, other=0.0).to(tl.float32)
            sum_va += tl.sum(tl.where(ok, va - ra, 0.0), axis=0)
            sum_vb += tl.sum(tl.where(ok, vb - rb, 0.0), axis=0)
    return sum_ka, sum_kb, sum_va, sum_vb


@triton.jit
def _sums_kernel(
    k_ptr,
    v_ptr,
    rows_ptr,
    slots_ptr,
    pos_ptr,
    seg_ptr,
    cache_ptr,
    cos_ptr,
    sin_ptr,
    sums_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c2,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    num_heads,
    half,
    head_dim,
    inv_scale_sq,
    DO_K: tl.constexpr,
    DO_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """sums[0 (K) / 1 (V), c, h] = the sum of (fresh - reused) over chunk c's recomputed rows."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    ka, kb, va, vb = _deviation_sums(
        k_ptr,
        v_ptr,
        rows_ptr,
        slots_ptr,
        pos_ptr,
        tl.load(seg_ptr + c),
        tl.load(seg_ptr + c + 1),
        cache_ptr,
        cos_ptr,
        sin_ptr,
        h,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_c2,
        stride_cb,
        stride_co,
        stride_ch,
        block_size,
        half,
        head_dim,
        inv_scale_sq,
        DO_K,
        DO_V,
        BLOCK_R,
        BLOCK_HALF,
    )
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    out = sums_ptr + (c * num_heads + h) * head_dim
    v_out = out + tl.num_programs(0) * num_heads * head_dim  # sums[1]: V
    tl.store(out + d, ka, mask=dmask)
    tl.store(out + half + d, kb, mask=dmask)
    tl.store(v_out + d, va, mask=dmask)
    tl.store(v_out + half + d, vb, mask=dmask)


@triton.jit
def _pooled(sums_ptr, sa, sb, h, num_chunks, num_heads, head_dim, half, total, shrink, d):
    """A chunk's sum (its two halves ``sa``, ``sb``) plus shrink x the pooled prior: every
    chunk's sum (``sums_ptr``: K's or V's), added in chunk order as torch adds them, over
    ``total + shrink``."""
    dmask = d < half
    pa = tl.zeros_like(sa)
    pb = tl.zeros_like(sb)
    for c2 in range(0, num_chunks):
        at = sums_ptr + (c2 * num_heads + h) * head_dim + d
        pa += tl.load(at, mask=dmask, other=0.0)
        pb += tl.load(at + half, mask=dmask, other=0.0)
    return sa + pa / (total + shrink) * shrink, sb + pb / (total + shrink) * shrink


@triton.jit
def _shift_kernel(
    k_ptr,
    v_ptr,
    rows_ptr,
    slots_ptr,
    pos_ptr,
    seg_ptr,
    kept_slots_ptr,
    kept_pos_ptr,
    kept_seg_ptr,
    cache_ptr,
    cos_ptr,
    sin_ptr,
    sums_ptr,
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
    num_heads,
    half,
    head_dim,
    inv_scale_sq,
    shrink,
    DO_K: tl.constexpr,
    DO_V: tl.constexpr,
    POOLED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.load(seg_ptr + c)
    hi = tl.load(seg_ptr + c + 1)
    total = tl.load(seg_ptr + num_chunks) - tl.load(seg_ptr)
    kept_lo = tl.load(kept_seg_ptr + c)
    kept_hi = tl.load(kept_seg_ptr + c + 1)
    per_part = tl.cdiv(kept_hi - kept_lo, tl.num_programs(2))
    kept_lo = kept_lo + tl.program_id(2) * per_part
    kept_hi = tl.minimum(kept_lo + per_part, kept_hi)
    if POOLED:
        moves = total > 0  # a chunk without recomputed rows still gets the prior
    else:
        moves = hi > lo
    if moves & (kept_hi > kept_lo):
        a = tl.arange(0, BLOCK_HALF)[None, :]
        amask = a < half
        d = tl.arange(0, BLOCK_HALF)
        if POOLED:  # the sums kernel ran first
            dmask = d < half
            at = sums_ptr + (c * num_heads + h) * head_dim + d
            v_sums = sums_ptr + num_chunks * num_heads * head_dim
            n_all = total.to(tl.float32)
            ska, skb = _pooled(
                sums_ptr,
                tl.load(at, mask=dmask, other=0.0),
                tl.load(at + half, mask=dmask, other=0.0),
                h,
                num_chunks,
                num_heads,
                head_dim,
                half,
                n_all,
                shrink,
                d,
            )
            at = at + num_chunks * num_heads * head_dim
            sva, svb = _pooled(
                v_sums,
                tl.load(at, mask=dmask, other=0.0),
                tl.load(at + half, mask=dmask, other=0.0),
                h,
                num_chunks,
                num_heads,
                head_dim,
                half,
                n_all,
                shrink,
                d,
            )
        else:
            ska, skb, sva, svb = _deviation_sums(
                k_ptr,
                v_ptr,
                rows_ptr,
                slots_ptr,
                pos_ptr,
                lo,
                hi,
                cache_ptr,
                cos_ptr,
                sin_ptr,
                h,
                stride_kt,
                stride_kh,
                stride_vt,
                stride_vh,
                stride_c2,
                stride_cb,
                stride_co,
                stride_ch,
                block_size,
                half,
                head_dim,
                inv_scale_sq,
                DO_K,
                DO_V,
                BLOCK_R,
                BLOCK_HALF,
            )
        weight = 1.0 / tl.maximum((hi - lo).to(tl.float32) + shrink, 1e-12)
        ska, skb = (ska * weight)[None, :], (skb * weight)[None, :]
        sva, svb = (sva * weight)[None, :], (svb * weight)[None, :]
        dt = cache_ptr.dtype.element_ty
        for start in range(kept_lo, kept_hi, BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)[:, None]
            ok = (r < kept_hi) & amask
            dst = _slot_head(
                cache_ptr,
                kept_slots_ptr,
                r,
                kept_hi,
                block_size,
                stride_cb,
                stride_co,
                h,
                stride_ch,
            )
            if DO_K:
                pos = tl.load(kept_pos_ptr + r, mask=r < kept_hi, other=0).to(tl.int64)
                cos_a, sin_a, cos_b, sin_b = _cos_sin(cos_ptr, sin_ptr, pos, head_dim, half, a, ok)
                # RoPE of the shift: s * cos + rotate_half(s) * sin
                moved_a = ska * cos_a - skb * sin_a
                moved_b = skb * cos_b + ska * sin_b
                cur_a = tl.load(dst + a, mask=ok, other=0.0).to(tl.float32)
                cur_b = tl.load(dst + half + a, mask=ok, other=0.0).to(tl.float32)
                tl.store(dst + a, (moved_a + cur_a).to(dt), mask=ok)
                tl.store(dst + half + a, (moved_b + cur_b).to(dt), mask=ok)
            if DO_V:
                cur_a = tl.load(dst + stride_c2 + a, mask=ok, other=0.0).to(tl.float32)
                cur_b = tl.load(dst + stride_c2 + half + a, mask=ok, other=0.0).to(tl.float32)
                tl.store(dst + stride_c2 + a, (sva + cur_a).to(dt), mask=ok)
                tl.store(dst + stride_c2 + half + a, (svb + cur_b).to(dt), mask=ok)


def shift_kept_rows(
    kv_cache: torch.Tensor,
    which: str,
    shrink: float,
    pooled: bool,
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
    the run of each chunk) still hold the reused K/V in the pool; ``kept`` rows carry their
    runs too (``segments``, and ``parts``: programs a chunk,
    ``blendkv.blend.correction.shift_parts``). ``cos`` / ``sin``: the float32 RoPE tables
    [max_position, D]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert kv_cache.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert head_dim % 2 == 0 and kept.segments is not None
    half = head_dim // 2
    common = dict(
        DO_K="k" in which, DO_V="v" in which, BLOCK_R=16, BLOCK_HALF=triton.next_power_of_2(half)
    )
    fresh = (k, v, recomputed.rows, recomputed.slots, recomputed.positions, recomputed.segments)
    strides = (*k.stride()[:2], *v.stride()[:2], *kv_cache.stride()[:4])
    sums = kv_cache  # a stand-in, never read: only the pooled prior reads sums
    if pooled:
        sums = kv_cache.new_empty((2, num_chunks, num_kv_heads, head_dim), dtype=torch.float32)
        _sums_kernel[(num_chunks, num_kv_heads)](
            *fresh,
            kv_cache,
            cos,
            sin,
            sums,
            *strides,
            block_size,
            num_kv_heads,
            half,
            head_dim,
            1.0 / attention_scaling**2,
            **common,
        )
    _shift_kernel[(num_chunks, num_kv_heads, kept.parts)](
        *fresh,
        kept.slots,
        kept.positions,
        kept.segments,
        kv_cache,
        cos,
        sin,
        sums,
        *strides,
        block_size,
        num_chunks,
        num_kv_heads,
        half,
        head_dim,
        1.0 / attention_scaling**2,
        float(shrink),
        POOLED=bool(pooled),
        **common,
    )
