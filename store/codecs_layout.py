"""Byte layout of an encoded chunk's payload: where each tensor of an :class:`EncodedKV` lies.

The value header (:mod:`blendkv.store.format`, version 2) records the codec and its parameters
(:class:`CodecParams`); from them and the shape, every section's dtype, shape and offset follow.
Sections, in this order, each starting at a multiple of 64 bytes from the payload's start (so
zero-copy views of LMDB's page-aligned values are aligned for every dtype)::

    k.q, k.scale, [k.zero], v.q, v.scale, [v.zero], [outlier_heads (u8 [L, H]), outlier_k]

Padding bytes are zero and covered by the checksum like the rest.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .codecs import EncodedKV, QuantizedPart

ALIGN = 64
CODEC_CODES = {"none": 0, "int8": 1, "int4": 2}
CODE_TO_CODEC = {code: name for name, code in CODEC_CODES.items()}
FLAG_K_ZERO, FLAG_V_ZERO, FLAG_OUTLIERS = 1, 2, 4


class CodecParams(NamedTuple):
    """The codec fields of a version-2 header (all 0 for ``none``)."""

    codec: str = "none"
    flags: int = 0
    k_group: tuple[int, int] = (0, 0)
    v_group: tuple[int, int] = (0, 0)
    num_outliers: int = 0


class Section(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the payload's start

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def params_of(enc: EncodedKV) -> CodecParams:
    flags = (FLAG_K_ZERO if enc.k.zero is not None else 0) | (
        FLAG_V_ZERO if enc.v.zero is not None else 0
    )
    n = 0
    if enc.outlier_heads is not None:
        flags |= FLAG_OUTLIERS
        n = int(enc.outlier_k.shape[0])
    return CodecParams(enc.codec, flags, enc.k.group, enc.v.group, n)


def sections(params: CodecParams, shape: tuple[int, ...], dtype: torch.dtype) -> list[Section]:
    """The payload's sections for an encoded value of decoded ``shape`` ``(L, 2, T, H, D)``.

    Raises ValueError when the parameters cannot describe such a value (a corrupt header)."""
    if params.codec not in ("int8", "int4") or len(shape) != 5 or shape[1] != 2:
        raise ValueError(f"codec {params.codec!r} with shape {shape}")
    L, _, T, H, D = shape
    bits = 8 if params.codec == "int8" else 4
    if bits == 4 and D % 2:
        raise ValueError(f"int4 value with odd head_dim {D}")
    out: list[Section] = []
    offset = 0

    def add(name: str, dt: torch.dtype, shp: tuple[int, ...]) -> None:
        nonlocal offset
        out.append(Section(name, dt, shp, offset))
        offset = _align(offset + out[-1].nbytes)

    for part, group, zero_flag in (
        ("k", params.k_group, FLAG_K_ZERO),
        ("v", params.v_group, FLAG_V_ZERO),
    ):
        gt, gd = group
        if gt < 1 or gd < 1:
            raise ValueError(f"group {group} of {part}")
        add(f"{part}.q", torch.int8 if bits == 8 else torch.uint8, (L, T, H, D * bits // 8))
        groups = (L, math.ceil(T / gt), H, math.ceil(D / gd))
        add(f"{part}.scale", torch.float16, groups)
        if params.flags & zero_flag:
            add(f"{part}.zero", torch.float16, groups)
    if params.flags & FLAG_OUTLIERS:
        if bits != 4 or not 0 < params.num_outliers <= L * H:
            raise ValueError(f"{params.num_outliers} outlier heads for codec {params.codec}")
        add("outlier_heads", torch.uint8, (L, H))
        add("outlier_k", dtype, (params.num_outliers, T, D))
    elif params.num_outliers:
        raise ValueError("outlier count without the outlier flag")
    return out


def payload_size(params: CodecParams, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    last = sections(params, shape, dtype)[-1]
    return _align(last.offset + last.nbytes)


def tensors_of(enc: EncodedKV) -> dict[str, torch.Tensor]:
    """The encoded value's tensors by section name."""
    out = {"k.q": enc.k.q, "k.scale": enc.k.scale, "v.q": enc.v.q, "v.scale": enc.v.scale}
    if enc.k.zero is not None:
        out["k.zero"] = enc.k.zero
    if enc.v.zero is not None:
        out["v.zero"] = enc.v.zero
    if enc.outlier_heads is not None:
        out["outlier_heads"] = enc.outlier_heads.to(torch.uint8)
        out["outlier_k"] = enc.outlier_k
    return out


def write_payload(enc: EncodedKV, out: memoryview) -> None:
    """Write ``enc``'s sections into ``out`` (a zeroed buffer of :func:`payload_size` bytes)."""
    by_name = tensors_of(enc)
    for sec in sections(params_of(enc), enc.shape, enc.dtype):
        t = by_name[sec.name]
        assert tuple(t.shape) == sec.shape and t.dtype == sec.dtype, (sec, t.shape, t.dtype)
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        out[sec.offset : sec.offset + sec.nbytes] = memoryview(flat.numpy()).cast("B")


def read_payload(
    payload: torch.Tensor, params: CodecParams, shape: tuple[int, ...], dtype: torch.dtype
) -> EncodedKV:
    """The :class:`EncodedKV` over a uint8 ``payload`` tensor (views, no copy)."""
    t: dict[str, torch.Tensor] = {}
    for sec in sections(params, shape, dtype):
        raw = payload[sec.offset : sec.offset + sec.nbytes]
        t[sec.name] = raw.view(sec.dtype).view(sec.shape)
    bits = 8 if params.codec == "int8" else 4
    k = QuantizedPart(t["k.q"], t["k.scale"], t.get("k.zero"), params.k_group, bits)
    v = QuantizedPart(t["v.q"], t["v.scale"], t.get("v.zero"), params.v_group, bits)
    heads = t["outlier_heads"].view(torch.bool) if "outlier_heads" in t else None
    return EncodedKV(params.codec, tuple(shape), dtype, k, v, heads, t.get("outlier_k"))
