"""Scatter a step's K/V into the paged pool (torch reference: :func:`write_kv_reference`, i.e.
``torch_attention.write_kv_cache`` over the rows with a valid slot).

Grid: one program per token; it copies that token's ``[kv_heads, head_dim]`` K and V tiles into
``slot = block_id * block_size + offset``. Rows with ``slot < 0`` are skipped (padding rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blendkv.kernels.torch_attention import write_kv_cache


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_c2,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = (
        cache_ptr
        + (slot // block_size) * stride_cb
        + (slot % block_size) * stride_co
        + h * stride_ch
        + d * stride_cd
    )
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c2, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k``/``v`` [num_tokens, kv_heads, head_dim] into ``kv_cache``
    [2, num_blocks, block_size, kv_heads, head_dim] at ``slot_mapping`` [num_tokens]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), (kv_cache.shape, k.shape)
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *kv_cache.stride(),
        kv_cache.shape[2],
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_reference(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference of :func:`write_kv`: ``write_kv_cache`` on the rows with ``slot >= 0``."""
    keep = slot_mapping >= 0
    write_kv_cache(kv_cache, k[keep], v[keep], slot_mapping[keep])
