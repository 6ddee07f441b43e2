"""Dequantising stored K/V while loading it into the pool.

A chunk stored with an ``int8`` / ``int4`` codec (``blendkv.store.codecs``) reaches the loader
as an :class:`EncodedChunk`: the encoded value's tensors, cut to the layers and tokens a request
loads without decoding anything (``chunk[first_layer:, :, first_token:]``, as the loader slices
a raw ``[L, 2, T, H, D]`` tensor). The load kernels dequantise it row by row while they rotate K
and write the pool (``dequant_rope_write_kv`` in ``kernels/cpu/rope_write.cpp``,
:func:`blendkv.kernels.triton.rope_load.dequant_rope_load`), so no full-precision copy of a chunk
exists outside the pool. Each of K and V is a group-wise affine code::

    x[l, t, h, d] = (q[l, t, h, d] - zero[l, t // gt, h, d // gd]) * scale[l, t // gt, h, d // gd]

computed in float32 and cast once to the pool dtype; outlier (layer, head) pairs keep their
keys in the model dtype. :meth:`EncodedChunk.dequantize` is the torch reference the kernels equal
bit for bit (after ``blend_kernels.load_rotated_reference`` rotates it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from blendkv.store.codecs import EncodedKV, QuantizedPart


def _layers(enc: EncodedKV, lo: int, hi: int) -> EncodedKV:
    """Layers ``lo .. hi`` of ``enc`` (views; the outlier keys' rows that belong to them)."""
    num_layers, _, num_tokens, heads, head_dim = enc.shape
    if (lo, hi) == (0, num_layers):
        return enc

    def part(p: QuantizedPart) -> QuantizedPart:
        zero = None if p.zero is None else p.zero[lo:hi]
        return replace(p, q=p.q[lo:hi], scale=p.scale[lo:hi], zero=zero)

    mask = outlier = None
    if enc.outlier_heads is not None:
        mask = enc.outlier_heads[lo:hi]
        first = int(enc.outlier_heads[:lo].sum())
        outlier = enc.outlier_k[first : first + int(mask.sum())]
    shape = (hi - lo, 2, num_tokens, heads, head_dim)
    return replace(
        enc, shape=shape, k=part(enc.k), v=part(enc.v), outlier_heads=mask, outlier_k=outlier
    )


@dataclass(frozen=True)
class EncodedChunk:
    """Tokens ``token_lo ..`` of an encoded chunk ``enc`` (its layers already cut: views). A
    token cut stays an offset, since int4 key groups span tokens. Behaves as much like the
    ``[L, 2, T, H, D]`` tensor it stands for as the loader needs (``shape``, ``len``, slicing,
    ``to``, ``nbytes``)."""

    enc: EncodedKV
    token_lo: int = 0

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        num_layers, two, num_tokens, heads, head_dim = self.enc.shape
        return (num_layers, two, num_tokens - self.token_lo, heads, head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.enc.dtype

    def __len__(self) -> int:
        return self.enc.shape[0]

    @property
    def device(self) -> torch.device:
        return self.enc.device

    @property
    def nbytes(self) -> int:
        """Bytes held (the encoded layers, all their tokens: what is read and copied)."""
        return self.enc.nbytes

    def __getitem__(self, key: slice | tuple) -> EncodedChunk:
        """``chunk[lo:hi]`` (layers) or ``chunk[layers, :, tokens_from:]``, plain slices."""
        layers, tokens = (key, slice(None)) if isinstance(key, slice) else (key[0], key[2])
        if isinstance(key, tuple):
            assert len(key) == 3 and key[1] == slice(None), key
        assert layers.step in (None, 1) and tokens.step in (None, 1), key
        assert tokens.stop is None and (tokens.start or 0) >= 0, key
        lo, hi, _ = layers.indices(len(self))
        token_lo = self.token_lo + (tokens.start or 0)
        assert token_lo <= self.enc.shape[2], (key, self.enc.shape)
        return EncodedChunk(_layers(self.enc, lo, max(lo, hi)), token_lo)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> EncodedChunk:
        return EncodedChunk(
            _moved(self.enc, lambda t: t.to(device, non_blocking=non_blocking)), self.token_lo
        )

    def pin_memory(self) -> EncodedChunk:
        return EncodedChunk(_moved(self.enc, lambda t: t.pin_memory()), self.token_lo)

    def is_pinned(self) -> bool:
        return all(t.is_pinned() for t in _tensors(self.enc))

    def record_stream(self, stream) -> None:
        for t in _tensors(self.enc):
            t.record_stream(stream)

    def outlier_index(self) -> torch.Tensor | None:
        """int64 ``[L, H]``: each outlier (layer, head)'s row of ``enc.outlier_k``, -1 else."""
        mask = self.enc.outlier_heads
        if mask is None:
            return None
        index = torch.cumsum(mask.flatten().long(), 0).sub_(1).view(mask.shape)
        return torch.where(mask, index, torch.full_like(index, -1))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The torch reference: ``decode_reference`` of the layers, from ``token_lo`` on (a
        full-precision copy: the kernels never make one)."""
        from blendkv.store.codecs import decode_reference

        return decode_reference(self.enc, dtype)[:, :, self.token_lo :]


def _tensors(enc: EncodedKV) -> list[torch.Tensor]:
    parts = (enc.k.q, enc.k.scale, enc.k.zero, enc.v.q, enc.v.scale, enc.v.zero)
    return [t for t in (*parts, enc.outlier_heads, enc.outlier_k) if t is not None]


def _moved(enc: EncodedKV, fn) -> EncodedKV:
    def opt(t):
        return None if t is None else fn(t)

    def part(p: QuantizedPart) -> QuantizedPart:
        return replace(p, q=fn(p.q), scale=fn(p.scale), zero=opt(p.zero))

    return replace(
        enc,
        k=part(enc.k),
        v=part(enc.v),
        outlier_heads=opt(enc.outlier_heads),
        outlier_k=opt(enc.outlier_k),
    )


def as_chunk(value) -> torch.Tensor | EncodedChunk:
    """A stored value as the loader handles it: a tensor (codec ``none``) as it is, an
    ``EncodedKV`` as a whole :class:`EncodedChunk`."""
    from blendkv.store.codecs import EncodedKV

    return EncodedChunk(value) if isinstance(value, EncodedKV) else value


def is_encoded(kv: object) -> bool:
    """Whether ``kv`` is an encoded chunk (a plain tensor is the ``none`` codec)."""
    return isinstance(kv, EncodedChunk)


def load_encoded_reference(
    backend, kv_caches, first_layer, chunk: EncodedChunk, positions, slots, cos, sin
) -> None:
    """The torch reference of a dequantising load: dequantise, then the reference rotation and write
    (``blend_kernels.load_rotated_reference``; what both kernels equal bit for bit)."""
    from blendkv.kernels.blend_kernels import load_rotated_reference

    kv = chunk.dequantize(kv_caches[first_layer].dtype)
    load_rotated_reference(backend, kv_caches, first_layer, kv, positions, slots, cos, sin)


def cpu_dequant_rope_write(
    ops, kv_caches, first_layer, chunk: EncodedChunk, positions, slots, cos, sin
) -> bool:
    """``dequant_rope_write_kv`` on these arguments; False (nothing written) where it does not
    take them (a float16 pool, a head_dim over 512, non-contiguous tables)."""
    pools = kv_caches[first_layer : first_layer + len(chunk)]
    dtype = pools[0].dtype if pools else None
    head_dim = chunk.shape[-1]
    if (
        dtype not in (torch.float32, torch.bfloat16)
        or head_dim % 2
        or head_dim > 512
        or chunk.device.type != "cpu"
        or positions.dtype != torch.int64
        or slots.dtype != torch.int64
        or cos.dtype != torch.float32
        or not (cos.is_contiguous() and sin.is_contiguous())
        or not all(p.is_contiguous() and p.dtype == dtype for p in pools)
    ):
        return False
    empty = torch.empty(0)
    enc = chunk.enc

    def part_args(p: QuantizedPart) -> list:
        # float32 scales and zeros: exact widenings of the stored float16 (1/D of the codes)
        zero = empty if p.zero is None else p.zero.float().contiguous()
        return [p.q.contiguous(), p.scale.float().contiguous(), zero, *p.group, p.bits]

    index = chunk.outlier_index()
    outlier_k = empty if enc.outlier_k is None else enc.outlier_k.to(dtype).contiguous()
    ops.dequant_rope_write_kv(
        *part_args(enc.k),
        *part_args(enc.v),
        empty if index is None else index,
        outlier_k,
        empty,  # no outlier values (store/codecs.py keeps keys only)
        chunk.token_lo,
        head_dim,
        kv_caches,
        first_layer,
        positions.contiguous(),
        slots.contiguous(),
        cos,
        sin,
    )
    return True
