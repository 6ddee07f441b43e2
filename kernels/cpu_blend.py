"""The blend's kernels in C++ on the CPU (:class:`CpuBlendKernels`, for the ``cpu`` attention
backend with its C++ ops built): a loaded chunk's K/V rotated into the pool
(``kernels/cpu/rope_write.cpp``; decoded as it is written: ``dequant_rope_write_kv``) and a
blended layer's K/V correction (``kernels/cpu/chunk_shift.cpp``). Each function returns whether
it took its arguments; if not, the torch reference (:class:`~.blend_kernels.BlendKernels`) runs,
which the tests hold them to.
"""

from __future__ import annotations

import torch

from blendkv.kernels.blend_kernels import BlendKernels
from blendkv.kernels.kv_dequant import cpu_dequant_rope_write

_DTYPES = (torch.float32, torch.bfloat16)


def rope_write_applies(kv, kv_caches, first_layer, positions, slots, cos, sin) -> bool:
    """Whether ``rope_write_kv`` takes these arguments."""
    pools = kv_caches[first_layer : first_layer + kv.shape[0]]
    return (
        kv.dtype in _DTYPES
        and kv.is_contiguous()
        and all(p.is_contiguous() for p in pools)
        and kv.shape[-1] % 2 == 0
        and kv.shape[-1] <= 512
        and positions.dtype == slots.dtype == torch.int64
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def rope_write(ops, kv, kv_caches, first_layer, positions, slots, cos, sin) -> bool:
    """Layers ``first_layer ..`` of a chunk's K (rotated to ``positions``) and V into the pools
    at ``slots``, as ``blend_kernels.load_rotated_reference`` writes them (the same bits)."""
    if not rope_write_applies(kv, kv_caches, first_layer, positions, slots, cos, sin):
        return False
    ops.rope_write_kv(kv, kv_caches, first_layer, positions, slots, cos, sin)
    return True


def shift_kept_rows(
    ops,
    kv_cache,
    which,
    shrink,
    pooled,
    k,
    v,
    recomputed,
    kept,
    num_chunks,
    cos,
    sin,
    attention_scaling,
) -> bool:
    """``blendkv.blend.correction.correct_kept_rows`` in one call (float32 or bfloat16)."""
    if (
        kv_cache.dtype not in _DTYPES
        or not kv_cache.is_contiguous()
        or k.dtype != kv_cache.dtype
        or v.dtype != kv_cache.dtype
        or k.stride(-1) != 1
        or v.stride(-1) != 1
    ):
        return False
    rows = (
        recomputed.rows,
        recomputed.slots,
        recomputed.positions,
        recomputed.chunk_ids,
        kept.slots,
        kept.positions,
        kept.chunk_ids,
    )
    ops.shift_kept_rows(
        kv_cache,
        {"k": 1, "v": 2, "kv": 3}[which],
        shrink,
        pooled,
        k,
        v,
        *(r.long().contiguous() for r in rows),
        num_chunks,
        cos.contiguous(),
        sin.contiguous(),
        float(attention_scaling),
    )
    return True


class CpuBlendKernels(BlendKernels):
    """The C++ kernels (``ops``: :func:`blendkv.kernels.cpu_extension.load_ops`'s, the ``cpu``
    attention backend's) where they take the arguments, else the torch reference."""

    name = "cpu"
    fused_chunk_shift = True

    def __init__(self, backend, ops) -> None:
        super().__init__(backend)
        assert ops is not None, "the C++ blend kernels need the built ops"
        self.ops = ops

    def load_rotated_kv(self, kv_caches, first_layer, kv, positions, slots, cos, sin) -> None:
        args = (kv, kv_caches, first_layer, positions, slots, cos, sin)
        if kv.dtype == kv_caches[0].dtype and rope_write(self.ops, *args):
            return
        super().load_rotated_kv(kv_caches, first_layer, kv, positions, slots, cos, sin)

    def load_encoded_kv(self, kv_caches, first_layer, chunk, positions, slots, cos, sin) -> None:
        """Decoded while written, by ``dequant_rope_write_kv`` (``kernels/cpu/rope_write.cpp``)."""
        args = (kv_caches, first_layer, chunk, positions, slots, cos, sin)
        if cpu_dequant_rope_write(self.ops, *args):
            return
        super().load_encoded_kv(*args)

    def shift_kept_rows(
        self,
        kv_cache,
        which,
        shrink,
        pooled,
        k,
        v,
        recomputed,
        kept,
        num_chunks,
        cos,
        sin,
        attention_scaling,
    ) -> bool:
        """The module's :func:`shift_kept_rows` on these ops."""
        return shift_kept_rows(
            self.ops,
            kv_cache,
            which,
            shrink,
            pooled,
            k,
            v,
            recomputed,
            kept,
            num_chunks,
            cos,
            sin,
            attention_scaling,
        )
