"""The blend's kernels in Triton (:class:`TritonBlendKernels`, for the ``triton`` attention
backend): a loaded chunk's K/V rotated into every layer of the pool in one launch
(:mod:`blendkv.kernels.triton.rope_load`, decoding an encoded chunk as it writes) and a blended
layer's K/V correction (:mod:`blendkv.kernels.triton.chunk_shift`). Triton is imported when
they are built, never at module import.
"""

from __future__ import annotations

from blendkv.kernels.blend_kernels import BlendKernels
from blendkv.kernels.triton_attention import TritonAttentionBackend, first_use


class TritonBlendKernels(BlendKernels):
    """The Triton kernels on ``backend``'s pool; the correction falls back to the torch code
    for good if its kernel fails to compile or launch the first time."""

    name = "triton"
    fused_chunk_shift = True

    def __init__(self, backend: TritonAttentionBackend) -> None:
        super().__init__(backend)
        from blendkv.kernels import triton as ops

        self._ops = ops
        self._kernel_ok: dict[str, bool] = {}  # chunk_shift: ran on first use (else torch)

    def load_rotated_kv(self, kv_caches, first_layer, kv, positions, slots, cos, sin) -> None:
        """Write a stored chunk's K (RoPE'd to ``positions``) and V into layers ``first_layer..``
        in one launch (see :func:`blendkv.kernels.triton.rope_load.rope_load`)."""
        self._ops.rope_load(kv_caches, first_layer, kv, positions, slots, cos, sin)

    def load_encoded_kv(self, kv_caches, first_layer, chunk, positions, slots, cos, sin) -> None:
        """Decoded in the RoPE-at-load kernel, in one launch
        (:func:`blendkv.kernels.triton.rope_load.dequant_rope_load`)."""
        from blendkv.kernels.triton.rope_load import dequant_rope_load

        dequant_rope_load(kv_caches, first_layer, chunk, positions, slots, cos, sin)

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
        """A blended layer's K/V correction in one launch, two with the pooled prior
        (:mod:`blendkv.kernels.triton.chunk_shift`); False if the kernels cannot run here (the
        caller then does it with torch ops)."""
        from blendkv.kernels.triton.chunk_shift import shift_kept_rows

        if kept.segments is None:
            return False
        args = (
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
        if first_use(self._kernel_ok, "chunk_shift", shift_kept_rows, *args):
            return True
        if self._kernel_ok["chunk_shift"]:
            shift_kept_rows(*args)
        return self._kernel_ok["chunk_shift"]
