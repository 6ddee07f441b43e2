"""Stored K/V codecs: ``none`` (raw tensor), ``int8`` and ``int4`` group-wise affine codes.

A chunk's K/V is ``kv [L, 2, T, Hkv, D]`` (dim 1: 0 = K before RoPE, 1 = V). ``encode`` turns
it into an :class:`EncodedKV` holding, for K and for V separately (a :class:`QuantizedPart`)::

    x[l, t, h, d] ~= (q[l, t, h, d] - zero[l, t // gt, h, d // gd]) * scale[l, t // gt, h, d // gd]

- ``q``: the signed codes. ``int8``: int8 ``[L, T, Hkv, D]`` in [-128, 127]. ``int4``: uint8
  ``[L, T, Hkv, D // 2]``, two signed 4-bit codes in [-8, 7] per byte as two's-complement
  nibbles: low nibble = even ``d``, high nibble = odd ``d`` (a nibble ``n >= 8`` is ``n - 16``).
- ``scale``: float16 ``[L, ceil(T / gt), Hkv, ceil(D / gd)]``, every entry a finite normal
  float16 (>= 2**-14). ``zero``: float16 of the same shape, or None (then the formula is
  ``q * scale``). float16 rather than bfloat16: three more mantissa bits for the same bytes,
  and a scale never exceeds ``max|x| / 7``, far inside float16's range for K/V.
- ``group = (gt, gd)``: recorded per part; ``int8`` K: ``(T, 1)`` (per channel over the
  chunk's tokens), ``int8`` V: ``(1, D)`` (per token); ``int4`` K: ``(INT4_KEY_GT, 1)``,
  ``int4`` V: ``(1, INT4_VALUE_GD)`` (capped at ``D``). Any group sizes decode the same way.
- ``outlier_heads``: ``int4`` only, bool ``[L, Hkv]`` (or None): those (layer, head) pairs'
  keys are kept in the model dtype in ``outlier_k [n, T, D]`` (``n`` = number of True entries,
  in row-major (layer, head) order) and override the decoded keys; their codes are still
  present (a decoder may ignore them). Values have no outlier heads.

Decoding (:func:`decode_reference`, the oracle every kernel must equal bit for bit): in
float32, ``(float(q) - float(zero)) * float(scale)`` (subtract, then multiply: no fused
multiply-add), or ``float(q) * float(scale)`` when ``zero`` is None, then ONE cast to the
output dtype (the pool's); outlier keys are cast from the model dtype to the output dtype.

The encoder rounds each scale *up* to float16 and keeps a group's zero only when the group's
codes then fit without clamping (else that group's zero is 0: symmetric), so every element obeys
``|x - x_hat| <= scale / 2`` up to float32 rounding (tests check exactly that bound).

The ``none`` codec is the raw tensor itself, bit for bit: no :class:`EncodedKV` is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .errors import CodecMismatchError

CODECS = ("none", "int8", "int4")
# Group sizes, asymmetric groups everywhere: chosen for the lowest reconstruction error at a
# size that leaves room for outlier heads (docs/guide/codecs.md says what they cost).
INT4_KEY_GT = 128  # tokens per int4 key group (one scale and zero per channel per 128 tokens)
INT4_VALUE_GD = 64  # channels per int4 value group (one scale and zero per token per 64)
# A head's int4 keys stay in the model dtype when ||K - K_hat||_F / ||K||_F exceeds this,
# the worst INT4_MAX_OUTLIER_FRACTION of a chunk's (layer, head) pairs at most (at least one).
INT4_OUTLIER_REL_ERROR = 0.1
INT4_MAX_OUTLIER_FRACTION = 0.02
_MIN_SCALE = 2.0**-14  # smallest normal float16


def check_codec(codec: str) -> str:
    """``codec`` if it is a known codec name, else ValueError naming the known ones."""
    if codec not in CODECS:
        raise ValueError(f"unknown K/V codec {codec!r}; use one of {', '.join(CODECS)}")
    return codec


@dataclass(frozen=True)
class QuantizedPart:
    """The group-wise affine code of K or of V (see the module docstring for the layout)."""

    q: torch.Tensor  # int8 [L, T, H, D] (8 bits) or uint8 [L, T, H, D // 2] (4 bits)
    scale: torch.Tensor  # float16 [L, ceil(T / gt), H, ceil(D / gd)]
    zero: torch.Tensor | None  # float16, same shape as scale, or None
    group: tuple[int, int]  # (gt, gd)
    bits: int  # 8 or 4

    @property
    def nbytes(self) -> int:
        tensors = (self.q, self.scale) + (() if self.zero is None else (self.zero,))
        return sum(t.numel() * t.element_size() for t in tensors)

    def layer(self, index: int) -> QuantizedPart:
        """The part of one layer (views, ``L = 1``)."""
        sl = slice(index, index + 1)
        zero = None if self.zero is None else self.zero[sl]
        return replace(self, q=self.q[sl], scale=self.scale[sl], zero=zero)

    def to(self, device: torch.device | str) -> QuantizedPart:
        zero = None if self.zero is None else self.zero.to(device)
        return replace(self, q=self.q.to(device), scale=self.scale.to(device), zero=zero)


@dataclass(frozen=True)
class EncodedKV:
    """One chunk's encoded K/V: ``codec`` ("int8" or "int4"), the decoded ``shape``
    ``(L, 2, T, H, D)`` and model ``dtype``, K and V parts, and int4's outlier heads."""

    codec: str
    shape: tuple[int, int, int, int, int]
    dtype: torch.dtype
    k: QuantizedPart
    v: QuantizedPart
    outlier_heads: torch.Tensor | None = None  # bool [L, H]
    outlier_k: torch.Tensor | None = None  # dtype [n, T, D]

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded tensors (what the memory tier counts)."""
        extra = 0
        for t in (self.outlier_heads, self.outlier_k):
            if t is not None:
                extra += t.numel() * t.element_size()
        return self.k.nbytes + self.v.nbytes + extra

    @property
    def device(self) -> torch.device:
        return self.k.q.device

    def layer(self, index: int) -> EncodedKV:
        """The encoded K/V of one layer (``L = 1``; views where possible)."""
        L, _, T, H, D = self.shape
        assert 0 <= index < L, (index, L)
        heads = outlier = None
        if self.outlier_heads is not None:
            heads = self.outlier_heads[index : index + 1]
            start = int(self.outlier_heads[:index].sum())
            outlier = self.outlier_k[start : start + int(heads.sum())]
        return replace(
            self,
            shape=(1, 2, T, H, D),
            k=self.k.layer(index),
            v=self.v.layer(index),
            outlier_heads=heads,
            outlier_k=outlier,
        )

    def to(self, device: torch.device | str) -> EncodedKV:
        heads = None if self.outlier_heads is None else self.outlier_heads.to(device)
        outlier = None if self.outlier_k is None else self.outlier_k.to(device)
        return replace(
            self,
            k=self.k.to(device),
            v=self.v.to(device),
            outlier_heads=heads,
            outlier_k=outlier,
        )


def kv_nbytes(value: torch.Tensor | EncodedKV) -> int:
    """Bytes a stored value's tensors take (raw tensor or encoded)."""
    if isinstance(value, EncodedKV):
        return value.nbytes
    return value.numel() * value.element_size()


# ---- encoding --------------------------------------------------------------------------------


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float16 rounded to a value >= x (x >= 2**-14, finite)."""
    # float16 spacing is 2**-10 relative, round-to-nearest moves at most half of it.
    return (x * (1.0 + 2.0**-10)).to(torch.float16)


def _group_minmax(x: torch.Tensor, gt: int, gd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of ``x [L, T, H, D]`` (float32) -> ``[L, Tg, H, Dg]`` each."""
    L, T, H, D = x.shape
    Tg, Dg = math.ceil(T / gt), math.ceil(D / gd)
    pad = (0, Dg * gd - D, 0, 0, 0, Tg * gt - T)
    lo = torch.nn.functional.pad(x, pad, value=math.inf).view(L, Tg, gt, H, Dg, gd)
    hi = torch.nn.functional.pad(x, pad, value=-math.inf).view(L, Tg, gt, H, Dg, gd)
    return lo.amin(dim=(2, 5)), hi.amax(dim=(2, 5))


def _expand(g: torch.Tensor, gt: int, gd: int, T: int, D: int) -> torch.Tensor:
    """A per-group tensor ``[L, Tg, H, Dg]`` repeated to ``[L, T, H, D]``."""
    return g.repeat_interleave(gt, dim=1)[:, :T].repeat_interleave(gd, dim=3)[..., :D]


def quantize_part(
    x: torch.Tensor, bits: int, group: tuple[int, int], *, asymmetric: bool = True
) -> QuantizedPart:
    """Group-wise affine code of ``x [L, T, H, D]`` (any float dtype) with ``bits`` 8 or 4."""
    assert bits in (8, 4), bits
    gt, gd = group
    L, T, H, D = x.shape
    assert gt >= 1 and gd >= 1, group
    if bits == 4 and D % 2:
        raise ValueError(f"int4 packs two codes per byte along head_dim; head_dim {D} is odd")
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    x = x.float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("K/V to encode holds inf or nan; store it with codec 'none'")
    lo, hi = _group_minmax(x, gt, gd)
    absmax = torch.maximum(lo.abs(), hi.abs())
    scale = _fp16_up((absmax / qmax).clamp_min(_MIN_SCALE))
    zero = None
    if asymmetric:
        scale_a = _fp16_up(((hi - lo) / (qmax - qmin)).clamp_min(_MIN_SCALE))
        sa = scale_a.float()
        zero_a = ((qmin + qmax) / 2 - (hi + lo) / (2 * sa)).to(torch.float16)
        za = zero_a.float()
        fits = (torch.round(lo / sa + za) >= qmin) & (torch.round(hi / sa + za) <= qmax)
        fits &= torch.isfinite(za)
        scale = torch.where(fits, scale_a, scale)
        zero = torch.where(fits, zero_a, torch.zeros_like(zero_a))
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("K/V values too large for float16 scales; store with codec 'none'")
    s = _expand(scale.float(), gt, gd, T, D)
    codes = x / s
    if zero is not None:
        codes = codes + _expand(zero.float(), gt, gd, T, D)
    codes = torch.round(codes)
    assert bool(((codes >= qmin) & (codes <= qmax)).all()), "codes out of range"
    q = codes.to(torch.int8)
    if bits == 4:
        nib = q.to(torch.uint8) & 0xF
        q = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return QuantizedPart(q.contiguous(), scale.contiguous(), zero, (gt, gd), bits)


def dequantize_part(part: QuantizedPart, num_tokens: int, head_dim: int) -> torch.Tensor:
    """float32 ``[L, T, H, D]`` of a part (the reference decode, before the output cast)."""
    gt, gd = part.group
    if part.bits == 8:
        codes = part.q.float()
    else:
        lo = (part.q & 0xF).to(torch.int16)
        hi = (part.q >> 4).to(torch.int16)
        nib = torch.stack((lo, hi), dim=-1).flatten(-2)
        codes = torch.where(nib >= 8, nib - 16, nib).float()
    scale = _expand(part.scale.float(), gt, gd, num_tokens, head_dim)
    if part.zero is None:
        return codes * scale
    return (codes - _expand(part.zero.float(), gt, gd, num_tokens, head_dim)) * scale


def head_errors(k: torch.Tensor, part: QuantizedPart) -> torch.Tensor:
    """float32 ``[L, H]``: each head's ``||K - K_hat||_F / ||K||_F`` over the chunk."""
    L, T, H, D = k.shape
    err = (dequantize_part(part, T, D) - k.float()).square().sum(dim=(1, 3))
    norm = k.float().square().sum(dim=(1, 3)).clamp_min(1e-30)
    return (err / norm).sqrt()


def _outlier_heads(k: torch.Tensor, part: QuantizedPart, threshold: float) -> torch.Tensor:
    """bool ``[L, H]``: heads whose keys' relative error exceeds ``threshold``, the worst
    ``INT4_MAX_OUTLIER_FRACTION`` of them at most (so the size bound holds)."""
    rel = head_errors(k, part)
    over = rel > threshold
    cap = max(1, int(INT4_MAX_OUTLIER_FRACTION * rel.numel()))
    if int(over.sum()) > cap:
        worst = rel.flatten().topk(cap).indices
        over = torch.zeros_like(over).flatten()
        over[worst] = True
        over = over.view(rel.shape)
    return over


def encode(
    kv: torch.Tensor,
    codec: str,
    *,
    outlier_threshold: float = INT4_OUTLIER_REL_ERROR,
    groups: tuple[tuple[int, int], tuple[int, int]] | None = None,
    asymmetric: tuple[bool, bool] = (True, True),
) -> torch.Tensor | EncodedKV:
    """Encode one chunk's ``kv [L, 2, T, H, D]`` with ``codec``; ``none`` returns ``kv``.

    ``outlier_threshold``: int4's outlier-head rule (relative Frobenius error of a head's keys
    over the chunk); ``math.inf`` disables outlier heads. ``groups`` (K's and V's ``(gt, gd)``)
    and ``asymmetric`` (K's, V's) override the codec's defaults (for measuring; a decoder
    reads whatever the value records).
    """
    check_codec(codec)
    if codec == "none":
        return kv
    if kv.ndim != 5 or kv.shape[1] != 2:
        raise ValueError(f"K/V must be [L, 2, T, H, D], got {tuple(kv.shape)}")
    L, _, T, H, D = kv.shape
    k, v = kv[:, 0], kv[:, 1]
    bits = 8 if codec == "int8" else 4
    if groups is None:
        if codec == "int8":
            groups = ((T, 1), (1, D))
        else:
            groups = ((INT4_KEY_GT, 1), (1, min(INT4_VALUE_GD, D)))
    kp = quantize_part(k, bits, groups[0], asymmetric=asymmetric[0])
    vp = quantize_part(v, bits, groups[1], asymmetric=asymmetric[1])
    if codec == "int8":
        return EncodedKV(codec, (L, 2, T, H, D), kv.dtype, kp, vp)
    heads = _outlier_heads(k, kp, outlier_threshold)
    if not bool(heads.any()):
        return EncodedKV(codec, (L, 2, T, H, D), kv.dtype, kp, vp)
    outlier = k.permute(0, 2, 1, 3)[heads].contiguous()  # [n, T, D] in (layer, head) order
    return EncodedKV(codec, (L, 2, T, H, D), kv.dtype, kp, vp, heads.contiguous(), outlier)


def decode_reference(enc: torch.Tensor | EncodedKV, dtype: torch.dtype | None = None):
    """The decoded ``[L, 2, T, H, D]`` in ``dtype`` (default: the model dtype).

    The oracle of every decode kernel (see the module docstring for the exact arithmetic).
    A plain tensor (codec ``none``) is returned cast to ``dtype``.
    """
    if not isinstance(enc, EncodedKV):
        return enc if dtype is None else enc.to(dtype)
    dtype = enc.dtype if dtype is None else dtype
    L, _, T, H, D = enc.shape
    out = torch.empty(enc.shape, dtype=dtype, device=enc.device)
    out[:, 0] = dequantize_part(enc.k, T, D).to(dtype)
    out[:, 1] = dequantize_part(enc.v, T, D).to(dtype)
    if enc.outlier_heads is not None:
        keys = out[:, 0].permute(0, 2, 1, 3)  # [L, H, T, D] view of the decoded keys
        keys[enc.outlier_heads] = enc.outlier_k.to(dtype)
    return out


def encode_for_store(
    codec: str, kv: torch.Tensor | EncodedKV, location: object
) -> torch.Tensor | EncodedKV:
    """``kv`` encoded with the store's ``codec``; an already encoded value must be of it
    (:class:`CodecMismatchError` naming both otherwise)."""
    if isinstance(kv, EncodedKV):
        if kv.codec != codec:
            raise CodecMismatchError(
                f"store {location} holds K/V of codec {codec!r}; refusing a value of codec "
                f"{kv.codec!r}",
                kv.codec,
                codec,
            )
        return kv
    return encode(kv, codec)
