"""RoPE at load: write a stored chunk's pre-RoPE K (rotated to its new positions) and V into
every layer's cache in one launch (torch reference: :func:`rope_load_reference`, i.e.
``RotaryEmbedding.rotate_k`` then ``write_kv_cache`` per layer).

Grid ``(num_tokens, num_layers)``: a program rotates one token's ``[kv_heads, head_dim]`` K of one
layer in float32 (HF ``rotate_half``: ``x * cos + cat(-x2, x1) * sin``), casts on store, and
copies its V. The layers' caches are addressed as one strided tensor ``[L, 2, num_blocks, ...]``
when they are views of one pool with a uniform layer stride (the engine allocates them so);
otherwise the kernel is launched once per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blendkv.kernels.torch_attention import write_kv_cache


@triton.jit
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
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    position = tl.load(positions_ptr + t).to(tl.int64)
    half = head_dim // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    src = kv_ptr + layer * stride_kl + t * stride_kt + h * stride_kh
    x = tl.load(src + d * stride_kd, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x)[d] = -x[d + half] for d < half, x[d - half] otherwise.
    first_half = d < half
    partner = tl.where(first_half, d + half, d - half)
    x_rot = tl.load(src + partner * stride_kd, mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.where(first_half, -x_rot, x_rot)
    cos = tl.load(cos_ptr + position * stride_rope + d, mask=d < head_dim, other=0.0)
    sin = tl.load(sin_ptr + position * stride_rope + d, mask=d < head_dim, other=0.0)
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
        _rope_load_kernel[(num_tokens, layer_kv.shape[0])](
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
            num_kv_heads,
            head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
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
