"""The layer's small element-wise steps as one launch each (torch references: the layers' own
code, :class:`~blendkv.layers.norm.RMSNorm`, :meth:`RotaryEmbedding.apply_rotary
<blendkv.layers.rotary.RotaryEmbedding.apply_rotary>`, ``F.silu(gate) * up``).

Eager RMSNorm+residual, RoPE and SiLU-and-mul are 23 tiny launches a layer, which bind a GPU
blended prefill (few rows a layer). Each kernel rounds where the torch code rounds, so results
agree with the references to float32 reduction order.

- :func:`rms_norm`: optional residual add, float32 normalisation, weight after the cast back;
  with a residual both inputs are overwritten (``x`` normalised, ``residual`` the sum; vLLM's
  fused_add_rms_norm).
- :func:`rotary_qk`: RoPE of q and k (any strides) at arbitrary positions, into new tensors;
  optionally the rotated K and V written into the paged pool in the same launch.
- :func:`silu_and_mul`: ``silu(gate) * up`` of a fused ``[T, 2 * I]`` gate/up output.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Rows a program: one on a GPU (the kernels as written and measured); the CPU interpreter pays
# per program, not per element, so there a program takes 16.
ROWS_PER_PROGRAM = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 1


@triton.jit(do_not_specialize=["rows"])  # one binary for every row count
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    w_ptr,
    stride_x,
    stride_r,
    stride_o,
    rows,
    n,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < n)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=1)[:, None] / n
    h = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` in one launch. Without ``residual``: a new tensor. With it: ``x``
    becomes the normalised rows and ``residual`` the sum ``x + residual``; returns both."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype == weight.dtype, (x.shape, x.dtype)
    rows, n = x.shape
    out = x if residual is not None else torch.empty_like(x)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
            x,
            x if residual is None else residual,
            out,
            weight,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            rows,
            n,
            eps,
            HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(n),
            ROWS=ROWS_PER_PROGRAM,
        )
    return out if residual is None else (out, residual)


@triton.jit
def _rotate(
    src_ptr,
    dst_ptr,
    t,
    tmask,
    cos,
    sin,
    stride_t,
    stride_h,
    num_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows ``t`` ([ROWS, 1, 1], ``tmask`` the real ones) of ``src`` rotated into ``dst``
    (contiguous); -> the rotated values (``dst``'s dtype), their head and dim indices and mask."""
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    dim = 2 * half
    mask = tmask & (h < num_heads) & (d < dim)
    partner = tl.where(d < half, d + half, d - half)
    base = src_ptr + t * stride_t + h * stride_h
    x = tl.load(base + d, mask=mask, other=0.0)
    rot = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
    rot = tl.where(d < half, -rot, rot)
    dt = dst_ptr.dtype.element_ty
    a = (x.to(tl.float32) * cos).to(dt).to(tl.float32)  # q * cos, rounded like torch
    b = (rot * sin).to(dt).to(tl.float32)  # rotate_half(q) * sin
    out = (a + b).to(dt)
    tl.store(dst_ptr + (t * num_heads + h) * dim + d, out, mask=mask)
    return out, h, d, mask


@triton.jit(do_not_specialize=["num_tokens"])
def _rotary_qk_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    num_heads,
    num_kv_heads,
    half,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_vt,
    stride_vh,
    stride_c2,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_KV: tl.constexpr,
    ROWS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None, None]
    tmask = t < num_tokens
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, None, :]
    dmask = tmask & (d < 2 * half)
    dt = q_out_ptr.dtype.element_ty
    # The tables are float32; torch casts them to the activations' dtype first.
    cos = tl.load(cos_ptr + pos * 2 * half + d, mask=dmask, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(sin_ptr + pos * 2 * half + d, mask=dmask, other=0.0).to(dt).to(tl.float32)
    _rotate(
        q_ptr,
        q_out_ptr,
        t,
        tmask,
        cos,
        sin,
        stride_qt,
        stride_qh,
        num_heads,
        half,
        BLOCK_H,
        BLOCK_D,
    )
    k, h, d, mask = _rotate(
        k_ptr,
        k_out_ptr,
        t,
        tmask,
        cos,
        sin,
        stride_kt,
        stride_kh,
        num_kv_heads,
        half,
        BLOCK_HKV,
        BLOCK_D,
    )
    if WRITE_KV:  # the rotated K and V into the pool (kv_write's layout; slot < 0: padding)
        slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
        mask = mask & (slot >= 0)
        slot = tl.where(slot >= 0, slot, 0)
        dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_co
        dst += h * stride_ch + d
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_c2, v.to(cache_ptr.dtype.element_ty), mask=mask)


def rotary_qk(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    kv_cache: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] (last dim contiguous), positions [T] -> rotated copies.
    ``cos_table`` / ``sin_table``: float32 [max_position, D], both halves stored.

    With ``kv_cache`` [2, num_blocks, block_size, Hkv, D] (contiguous heads and dims), ``v``
    [T, Hkv, D] and ``slot_mapping`` [T]: the same launch also writes the rotated K and V into
    the pool, as :func:`~blendkv.kernels.triton.kv_write.write_kv` would (rows with a slot
    below 0 are not written)."""
    num_tokens, num_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and k.dtype == q.dtype and dim % 2 == 0
    assert cos_table.is_contiguous() and cos_table.shape[1] == dim, cos_table.shape
    q_out = torch.empty((num_tokens, num_heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, dim), dtype=k.dtype, device=k.device)
    write = kv_cache is not None
    if write:
        assert v is not None and v.shape == k.shape and v.stride(2) == 1
        assert slot_mapping is not None and slot_mapping.shape == (num_tokens,)
        assert kv_cache.shape[3:] == (num_kv_heads, dim) and kv_cache.stride(4) == 1
        cache_strides = (*kv_cache.stride()[:4], kv_cache.shape[2])
        v_strides = (v.stride(0), v.stride(1))
    else:  # (unused: WRITE_KV is off)
        kv_cache, v, slot_mapping = q_out, k_out, positions
        cache_strides, v_strides = (0, 0, 0, 0, 1), (0, 0)
    if num_tokens:
        _rotary_qk_kernel[(triton.cdiv(num_tokens, ROWS_PER_PROGRAM),)](
            q,
            k,
            q_out,
            k_out,
            positions,
            cos_table,
            sin_table,
            num_tokens,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            num_heads,
            num_kv_heads,
            dim // 2,
            v,
            kv_cache,
            slot_mapping,
            *v_strides,
            *cache_strides,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(dim),
            WRITE_KV=write,
            ROWS=ROWS_PER_PROGRAM,
        )
    return q_out, k_out


@triton.jit(do_not_specialize=["rows"])
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, rows, n, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < n)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # silu(gate), rounded
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dt), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate columns first, then up; rows contiguous) -> [T, I]."""
    rows, width = gate_up.shape
    assert gate_up.stride(1) == 1 and width % 2 == 0
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            rows,
            n,
            BLOCK=block,
            ROWS=ROWS_PER_PROGRAM,
        )
    return out
