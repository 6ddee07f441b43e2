"""RoPE at load: write a stored chunk's pre-RoPE K (rotated to its new positions) and V into
every layer's cache in one launch (torch reference: :func:`rope_load_reference`, i.e.
``RotaryEmbedding.rotate_k`` then ``write_kv_cache`` per layer).

Grid ``(num_tokens / rows, num_layers)``: a program rotates the ``[kv_heads, head_dim]`` K of
one layer's tokens (one on a GPU, 16 under the interpreter) in float32 (HF ``rotate_half``:
``x * cos + cat(-x2, x1) * sin``), casts on store, and copies its V. The layers' caches are
addressed as one strided tensor ``[L, 2, num_blocks, ...]`` when they are views of one pool with
a uniform layer stride (the engine allocates them so); otherwise the kernel is launched once per
layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blendkv.kernels.torch_attention import write_kv_cache
from blendkv.kernels.triton.elementwise import ROWS_PER_PROGRAM


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_load_kernel(
    kv_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    stride_kl,
    stride_k2,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cl,
    stride_c2,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    stride_rope,
    block_size,
    num_tokens,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None, None]
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    position = tl.load(positions_ptr + t, mask=slot >= 0, other=0).to(tl.int64)
    half = head_dim // 2
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    mask = (slot >= 0) & (h < num_kv_heads) & (d < head_dim)
    slot = tl.where(slot >= 0, slot, 0)
    src = kv_ptr + layer * stride_kl + t * stride_kt + h * stride_kh
    x = tl.load(src + d * stride_kd, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x)[d] = -x[d + half] for d < half, x[d - half] otherwise.
    first_half = d < half
    partner = tl.where(first_half, d + half, d - half)
    x_rot = tl.load(src + partner * stride_kd, mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.where(first_half, -x_rot, x_rot)
    rope_mask = (t < num_tokens) & (d < head_dim)
    cos = tl.load(cos_ptr + position * stride_rope + d, mask=rope_mask, other=0.0)
    sin = tl.load(sin_ptr + position * stride_rope + d, mask=rope_mask, other=0.0)
    k = x * cos + x_rot * sin
    v = tl.load(src + stride_k2 + d * stride_kd, mask=mask, other=0.0)
    dst = (
        cache_ptr
        + layer * stride_cl
        + (slot // block_size) * stride_cb
        + (slot % block_size) * stride_co
        + h * stride_ch
        + d * stride_cd
    )
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c2, v.to(cache_ptr.dtype.element_ty), mask=mask)


def stacked_layers(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """``caches`` as one ``[L, *layer_shape]`` view when they are views of one storage with a
    uniform, positive layer stride; None otherwise."""
    base = caches[0]
    if len(caches) == 1:
        return base.unsqueeze(0)
    same_layout = all(
        c.shape == base.shape
        and c.stride() == base.stride()
        and c.dtype == base.dtype
        and c.device == base.device
        and c.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        for c in caches
    )
    if not same_layout:
        return None
    offsets = [c.storage_offset() for c in caches]
    step = offsets[1] - offsets[0]
    if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:], strict=False)):
        return None
    return torch.as_strided(base, (len(caches), *base.shape), (step, *base.stride()), offsets[0])


def rope_load(
    kv_caches: list[torch.Tensor],
    first_layer: int,
    kv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Write a chunk's K (rotated to ``positions``) and V into layers ``first_layer ..``.

    Args:
        kv_caches: every layer's cache, [2, num_blocks, block_size, kv_heads, head_dim].
        kv: [num_layers', 2, num_tokens, kv_heads, head_dim], pre-RoPE K and V of layers
            ``first_layer .. first_layer + num_layers' - 1``.
        positions: [num_tokens] int64 target absolute positions; slots: [num_tokens] int64
            (rows with ``slot < 0`` are skipped).
        cos, sin: [max_position, head_dim] float32 rotary tables (both halves stored).
    """
    num_layers, two, num_tokens, num_kv_heads, head_dim = kv.shape
    caches = kv_caches[first_layer : first_layer + num_layers]
    assert two == 2 and len(caches) == num_layers, (kv.shape, first_layer, len(kv_caches))
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.stride() == sin.stride()
    assert cos.dtype == torch.float32 and cos.stride(1) == 1
    if num_tokens == 0:
        return
    stacked = stacked_layers(caches)
    groups = (
        [(stacked, kv)]
        if stacked is not None
        else [(c[None], kv[i : i + 1]) for i, c in enumerate(caches)]
    )
    for cache, layer_kv in groups:
        _rope_load_kernel[(triton.cdiv(num_tokens, ROWS_PER_PROGRAM), layer_kv.shape[0])](
            layer_kv,
            positions,
            slots,
            cos,
            sin,
            cache,
            *layer_kv.stride(),
            *cache.stride(),
            cos.stride(0),
            cache.shape[3],
            num_tokens,
            num_kv_heads,
            head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            ROWS=ROWS_PER_PROGRAM,
        )


def rope_load_reference(
    kv_caches: list[torch.Tensor],
    first_layer: int,
    kv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Torch reference of :func:`rope_load`, computed like ``RotaryEmbedding.rotate_k`` (in the
    K dtype, cos/sin cast to it) followed by ``write_kv_cache`` per layer."""
    keep = slots >= 0
    kv, positions, slots = kv[:, :, keep], positions[keep], slots[keep]
    for i in range(kv.shape[0]):
        k, v = kv[i, 0], kv[i, 1]
        c = cos[positions][:, None, :].to(k.dtype)
        s = sin[positions][:, None, :].to(k.dtype)
        x1, x2 = k.chunk(2, dim=-1)
        rotated = k * c + torch.cat((-x2, x1), dim=-1) * s
        write_kv_cache(kv_caches[first_layer + i], rotated, v, slots)


# ---- dequantise at load-------------------------------------------------------------------
@triton.jit
def _decode_rows(
    q_ptr,
    s_ptr,
    z_ptr,
    layer,
    t,
    h,
    d,
    mask,
    num_tokens,
    num_kv_heads,
    head_dim,
    gt,
    gd,
    groups_t,
    groups_d,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
):
    """float32 ``(q - zero) * scale`` of rows ``(layer, t, h)`` at channels ``d`` (contiguous
    codes and groups, :mod:`blendkv.store.codecs`' layout)."""
    row = (layer * num_tokens + t) * num_kv_heads + h
    if BITS == 8:
        code = tl.load(q_ptr + row * head_dim + d, mask=mask, other=0).to(tl.float32)
    else:  # two's-complement nibbles, low = even d
        byte = tl.load(q_ptr + row * (head_dim // 2) + d // 2, mask=mask, other=0).to(tl.int32)
        nib = (byte >> ((d % 2) * 4)) & 0xF
        code = tl.where(nib >= 8, nib - 16, nib).to(tl.float32)
    g = ((layer * groups_t + t // gt) * num_kv_heads + h) * groups_d + d // gd
    scale = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        zero = tl.load(z_ptr + g, mask=mask, other=0.0).to(tl.float32)
        return (code - zero) * scale
    else:
        return code * scale


@triton.jit
def _dequant_rope_load_kernel(
    kq_ptr,
    ks_ptr,
    kz_ptr,
    vq_ptr,
    vs_ptr,
    vz_ptr,
    outlier_index_ptr,
    outlier_k_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    num_tokens,  # the encoded chunk's, T (codes address tokens token_lo + program_id(0))
    token_lo,
    k_gt,
    k_gd,
    k_groups_t,
    k_groups_d,
    v_gt,
    v_gd,
    v_groups_t,
    v_groups_d,
    stride_cl,
    stride_c2,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    stride_rope,
    block_size,
    num_kv_heads,
    head_dim,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_ZERO: tl.constexpr,
    V_ZERO: tl.constexpr,
    OUTLIERS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if slot < 0:
        return
    t = token_lo + i
    position = tl.load(positions_ptr + i).to(tl.int64)
    half = head_dim // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    first_half = d < half
    partner = tl.where(first_half, d + half, d - half)
    dt = cache_ptr.dtype.element_ty
    # K and its rotate_half partner, decoded in float32, each cast once to the pool dtype.
    x = _decode_rows(
        kq_ptr,
        ks_ptr,
        kz_ptr,
        layer,
        t,
        h,
        d,
        mask,
        num_tokens,
        num_kv_heads,
        head_dim,
        k_gt,
        k_gd,
        k_groups_t,
        k_groups_d,
        K_BITS,
        K_ZERO,
    )
    x_p = _decode_rows(
        kq_ptr,
        ks_ptr,
        kz_ptr,
        layer,
        t,
        h,
        partner,
        mask,
        num_tokens,
        num_kv_heads,
        head_dim,
        k_gt,
        k_gd,
        k_groups_t,
        k_groups_d,
        K_BITS,
        K_ZERO,
    )
    x = x.to(dt).to(tl.float32)
    x_p = x_p.to(dt).to(tl.float32)
    if OUTLIERS:  # heads kept in the pool dtype: [n, T, D] rows
        row = tl.load(outlier_index_ptr + layer * num_kv_heads + h, mask=h < num_kv_heads, other=-1)
        src = outlier_k_ptr + (row * num_tokens + t) * head_dim
        is_out = mask & (row >= 0)
        x = tl.where(is_out, tl.load(src + d, mask=is_out, other=0.0).to(tl.float32), x)
        x_p = tl.where(is_out, tl.load(src + partner, mask=is_out, other=0.0).to(tl.float32), x_p)
    # rotate_half as the reference computes it in the pool dtype: each product and the sum
    # rounded to it (no-ops for float32; launched without FMA contraction).
    x_rot = tl.where(first_half, -x_p, x_p)
    cos = tl.load(cos_ptr + position * stride_rope + d, mask=d < head_dim, other=0.0)
    sin = tl.load(sin_ptr + position * stride_rope + d, mask=d < head_dim, other=0.0)
    cos = cos.to(dt).to(tl.float32)
    sin = sin.to(dt).to(tl.float32)
    p1 = (x * cos).to(dt).to(tl.float32)
    p2 = (x_rot * sin).to(dt).to(tl.float32)
    k = (p1 + p2).to(dt)
    v = _decode_rows(
        vq_ptr,
        vs_ptr,
        vz_ptr,
        layer,
        t,
        h,
        d,
        mask,
        num_tokens,
        num_kv_heads,
        head_dim,
        v_gt,
        v_gd,
        v_groups_t,
        v_groups_d,
        V_BITS,
        V_ZERO,
    )
    dst = (
        cache_ptr
        + layer * stride_cl
        + (slot // block_size) * stride_cb
        + (slot % block_size) * stride_co
        + h * stride_ch
        + d * stride_cd
    )
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c2, v.to(dt), mask=mask)


def dequant_rope_load(
    kv_caches: list[torch.Tensor],
    first_layer: int,
    chunk,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """:func:`rope_load` of an encoded chunk (:class:`blendkv.kernels.kv_dequant.EncodedChunk`,
    on the caches' device): decoded in the kernel, in one launch per layer group. Torch
    reference: :func:`dequant_rope_load_reference` (the same bits)."""
    num_layers, _, num_new, num_kv_heads, head_dim = chunk.shape
    caches = kv_caches[first_layer : first_layer + num_layers]
    assert len(caches) == num_layers and num_new == positions.numel() == slots.numel()
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.stride() == sin.stride()
    assert cos.dtype == torch.float32 and cos.stride(1) == 1
    if num_new == 0 or num_layers == 0:
        return
    enc = chunk.enc
    num_tokens = enc.shape[2]
    dtype = caches[0].dtype
    index = chunk.outlier_index()
    outlier_k = enc.outlier_k.to(dtype).contiguous() if index is not None else None

    def part(p):
        gt, gd = p.group
        zero = p.scale if p.zero is None else p.zero.contiguous()
        groups = (p.scale.shape[1], p.scale.shape[3])
        return p.q.contiguous(), p.scale.contiguous(), zero, (gt, gd, *groups)

    kq, ks, kz, kg = part(enc.k)
    vq, vs, vz, vg = part(enc.v)
    stacked = stacked_layers(caches)
    groups = (
        [(stacked, 0, num_layers)]
        if stacked is not None
        else [(c[None], i, i + 1) for i, c in enumerate(caches)]
    )
    for cache, lo, hi in groups:
        # Layers lo..hi of the codes: offsets into contiguous [L, ...] tensors.
        def at(x, lo=lo):
            return x[lo:]

        _dequant_rope_load_kernel[(num_new, hi - lo)](
            at(kq),
            at(ks),
            at(kz),
            at(vq),
            at(vs),
            at(vz),
            at(index) if index is not None else ks,
            outlier_k[int(enc.outlier_heads[:lo].sum()) :] if index is not None else ks,
            positions,
            slots,
            cos,
            sin,
            cache,
            num_tokens,
            chunk.token_lo,
            *kg,
            *vg,
            *cache.stride(),
            cos.stride(0),
            cache.shape[3],
            num_kv_heads,
            head_dim,
            K_BITS=enc.k.bits,
            V_BITS=enc.v.bits,
            K_ZERO=enc.k.zero is not None,
            V_ZERO=enc.v.zero is not None,
            OUTLIERS=index is not None,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            enable_fp_fusion=False,
        )


def dequant_rope_load_reference(
    kv_caches: list[torch.Tensor],
    first_layer: int,
    chunk,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Torch reference of :func:`dequant_rope_load`: ``decode_reference`` in the pool dtype, then
    :func:`rope_load_reference`."""
    kv = chunk.dequantize(kv_caches[first_layer].dtype)
    rope_load_reference(kv_caches, first_layer, kv, positions, slots, cos, sin)
