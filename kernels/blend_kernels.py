"""The blend's kernels on the paged KV pool: a loaded chunk's K/V written into the pool with
RoPE at its positions in the fused prompt (``load_rotated_kv``; decoded as it is written:
``load_encoded_kv``) and a blended layer's K/V correction (``shift_kept_rows``).

They are not attention: the attention backend (:mod:`.attention`) owns the pool's layout and
its writes, which these go through. :class:`BlendKernels` is the torch implementation (the
reference the others are held to, bit for bit); :mod:`.cpu_blend` and :mod:`.triton_blend`
are the C++ and Triton ones, and :func:`blendkv.kernels.backends.get_blend_kernels` picks the
one for an attention backend.
"""

from __future__ import annotations

from typing import Any

import torch

from blendkv.kernels.attention import AttentionBackend
from blendkv.kernels.torch_attention import slot_runs


def load_rotated_reference(
    backend: AttentionBackend,
    kv_caches: list[torch.Tensor],
    first_layer: int,
    kv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """The reference of :meth:`BlendKernels.load_rotated_kv`: RoPE in the K/V dtype, like
    ``RotaryEmbedding.rotate_k``, then one ``backend.write_kv`` per layer."""
    k = kv[:, 0]  # [L', T, H, D]
    # index_select, not advanced indexing: the fast CPU gather of table rows
    c = cos.index_select(0, positions)[:, None, :].to(k.dtype)  # [T, 1, D]
    s = sin.index_select(0, positions)[:, None, :].to(k.dtype)
    half = k.shape[-1] // 2
    rotated = k * c + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * s
    for i in range(kv.shape[0]):
        backend.write_kv(kv_caches[first_layer + i], rotated[i], kv[i, 1], slots)


def _rotate_runs(kv_caches, first_layer, kv, positions, slots, cos, sin) -> None:
    """:func:`load_rotated_reference`'s bits on the CPU: K rotated straight into the pool and
    V copied, run by run of consecutive slots (no rotated copy of K and no ``index_copy_``);
    each half of the rotation is its two products and one sum, rounded as it rounds them."""
    num_kv_heads, head_dim = kv.shape[-2:]
    half = head_dim // 2
    c = cos.index_select(0, positions)[:, None, :].to(kv.dtype)  # [T, 1, D]
    s = sin.index_select(0, positions)[:, None, :].to(kv.dtype)
    for lo, hi, slot in slot_runs(slots):
        c1, c2, s1, s2 = (
            c[lo:hi, :, :half],
            c[lo:hi, :, half:],
            s[lo:hi, :, :half],
            s[lo:hi, :, half:],
        )
        for i in range(kv.shape[0]):
            pool = kv_caches[first_layer + i].view(2, -1, num_kv_heads, head_dim)
            dst = pool[:, slot : slot + hi - lo]
            k1, k2 = kv[i, 0, lo:hi, :, :half], kv[i, 0, lo:hi, :, half:]
            d1, d2 = dst[0, :, :, :half], dst[0, :, :, half:]
            torch.mul(k1, c1, out=d1).sub_(k2 * s1)  # k1 c - k2 s
            torch.mul(k2, c2, out=d2).add_(k1 * s2)  # k2 c + k1 s
            dst[1].copy_(kv[i, 1, lo:hi])


class BlendKernels:
    """The blend's ops on ``backend``'s pool, in torch (any device): the reference."""

    name = "torch"
    # Its :meth:`shift_kept_rows` takes the correction (the row plan then builds the
    # recomputed rows' chunk segments it needs); else the blend runs the torch code.
    fused_chunk_shift: bool = False

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def load_rotated_kv(
        self,
        kv_caches: list[torch.Tensor],
        first_layer: int,
        kv: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Write a stored chunk's K/V into the pool for layers ``first_layer..``.

        Args:
            kv: [L', 2, T, kv_heads, head_dim]; index 0 is K *before* RoPE (rotated here to
                ``positions``), index 1 is V. ``L' = len(kv_caches) - first_layer``.
            positions: [T] int64 absolute positions of the chunk's tokens in this prompt.
            slots: [T] int64 KV slots they are written to.
            cos, sin: [max_position, head_dim] float32 rotary tables (both halves stored,
                HF ``rotate_half`` convention), from ``RotaryEmbedding.tables``.

        Writes :func:`load_rotated_reference`'s bits; on the CPU (K/V in the pool's dtype) run
        by run of consecutive slots; subclasses may fuse it into one launch.
        """
        if self.backend.device.type != "cpu" or kv.dtype != kv_caches[0].dtype:
            load_rotated_reference(
                self.backend, kv_caches, first_layer, kv, positions, slots, cos, sin
            )
            return
        _rotate_runs(kv_caches, first_layer, kv, positions, slots, cos, sin)

    def load_encoded_kv(
        self,
        kv_caches: list[torch.Tensor],
        first_layer: int,
        chunk: Any,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """:meth:`load_rotated_kv` of an encoded chunk (an ``int8`` / ``int4`` store's value,
        :class:`blendkv.kernels.kv_dequant.EncodedChunk`), decoded as it is written. This is the
        reference (decode, then :func:`load_rotated_reference`); subclasses decode in their
        load kernels instead, writing the same bits."""
        kv = chunk.dequantize(kv_caches[first_layer].dtype)
        load_rotated_reference(self.backend, kv_caches, first_layer, kv, positions, slots, cos, sin)

    def shift_kept_rows(
        self,
        kv_cache: torch.Tensor,
        which: str,
        shrink: float,
        pooled: bool,
        k: torch.Tensor,
        v: torch.Tensor,
        recomputed: Any,
        kept: Any,
        num_chunks: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_scaling: float,
    ) -> bool:
        """A blended layer's K/V correction (``blendkv.blend.correction.correct_kept_rows``) in
        these kernels; returns whether it did it. Called only with :attr:`fused_chunk_shift`
        (``segments`` set on both row sets). The reference is the blend's torch code, which
        runs when this returns False: here, always."""
        return False
