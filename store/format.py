"""Binary layout of one stored chunk K/V value: a fixed 64-byte header, then the payload.

Version 2 (written now)::

    offset  size  field
    0       4     magic  b"BKVC"
    4       2     format version (u16): 2
    6       1     dtype code (u8): 1 float32, 2 bfloat16, 3 float16 (the model's K/V dtype)
    7       1     ndim (u8, 1..5)
    8       8     checksum: xxh3_64 of bytes 0..8 and 16..end (all but this field) (u64)
    16      8     payload size in bytes (u64)
    24      20    shape, 5 x u32 (unused dims are 0): the decoded K/V's shape
    44      1     codec (u8): 0 none, 1 int8, 2 int4 (:mod:`blendkv.store.codecs`)
    45      1     codec flags (u8): 1 K has zeros, 2 V has zeros, 4 int4 outlier heads
    46      2     reserved, 0
    48      4     K group tokens gt (u32)     52  2  K group channels gd (u16)
    54      4     V group tokens gt (u32)     58  2  V group channels gd (u16)
    60      4     number of outlier heads (u32)
    64      ...   payload: ``none``: the tensor's bytes, C order, little-endian (bit for bit
                  version 1's payload); ``int8`` / ``int4``: the sections of
                  :mod:`blendkv.store.codecs_layout`

Version 1 (still read, as codec ``none``): the same first 24 bytes (its checksum covers only
the payload), then the shape as 5 x u64 at offset 24. All integers are little-endian. The header
is 64 bytes so the payload keeps the alignment of LMDB's page-aligned overflow pages, which lets
``torch.frombuffer`` view it without a copy. No pickle and no ``torch.load``: a value is only
ever interpreted as numbers.
"""

from __future__ import annotations

import math
import struct
import warnings
from typing import NamedTuple

import torch
import xxhash

from . import codecs_layout as layout
from .codecs import EncodedKV
from .codecs_layout import CodecParams
from .errors import CodecMismatchError, CorruptValueError

MAGIC = b"BKVC"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
HEADER_SIZE = 64
MAX_NDIM = 5

_PREFIX = struct.Struct("<4sHBBQQ")  # magic, version, dtype, ndim, checksum, payload size
_HEADER_V1 = struct.Struct("<4sHBBQQ5Q")
_HEADER = struct.Struct("<4sHBBQQ5IBBHIHIHI")
assert _HEADER_V1.size == HEADER_SIZE and _HEADER.size == HEADER_SIZE

DTYPE_TO_CODE: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_TO_DTYPE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_TO_CODE.items()}


class ValueHeader(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    checksum: int
    nbytes: int
    params: CodecParams = CodecParams()
    version: int = FORMAT_VERSION

    @property
    def codec(self) -> str:
        return self.params.codec


def checksum(payload) -> int:
    """xxh3_64 of a bytes-like payload (any object with the buffer protocol)."""
    return xxhash.xxh3_64_intdigest(payload)


def value_checksum(value, version: int = FORMAT_VERSION) -> int:
    """The checksum a value's header must hold: version 2 covers all but the checksum field
    (the codec parameters included), version 1 only the payload."""
    view = memoryview(value)
    if version == 1:
        return checksum(view[HEADER_SIZE:])
    h = xxhash.xxh3_64()
    h.update(view[:8])
    h.update(view[16:])
    return h.intdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes as a flat memoryview (copies only if not contiguous or on a GPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _pack_header(
    dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, params: CodecParams
) -> bytes:
    if dtype not in DTYPE_TO_CODE:
        raise ValueError(f"unsupported dtype {dtype}; use one of {list(DTYPE_TO_CODE)}")
    if not 1 <= len(shape) <= MAX_NDIM:
        raise ValueError(f"tensor must have 1..{MAX_NDIM} dims, got shape {tuple(shape)}")
    if any(d >= 1 << 32 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has a dim too large for the value header")
    dims = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    return _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        DTYPE_TO_CODE[dtype],
        len(shape),
        0,
        nbytes,
        *dims,
        layout.CODEC_CODES[params.codec],
        params.flags,
        0,
        params.k_group[0],
        params.k_group[1],
        params.v_group[0],
        params.v_group[1],
        params.num_outliers,
    )


def encode_value(value: torch.Tensor | EncodedKV) -> bytearray:
    """Header plus payload in one buffer (one copy of the tensor's bytes); a plain tensor is
    codec ``none``."""
    if isinstance(value, EncodedKV):
        params = layout.params_of(value)
        size = layout.payload_size(params, value.shape, value.dtype)
        buf = bytearray(HEADER_SIZE + size)
        buf[:HEADER_SIZE] = _pack_header(value.dtype, value.shape, size, params)
        layout.write_payload(value, memoryview(buf)[HEADER_SIZE:])
    else:
        payload = tensor_bytes(value)
        buf = bytearray(HEADER_SIZE + len(payload))
        buf[:HEADER_SIZE] = _pack_header(
            value.dtype, tuple(value.shape), len(payload), CodecParams()
        )
        buf[HEADER_SIZE:] = payload
    struct.pack_into("<Q", buf, 8, value_checksum(buf))
    return buf


def _unpack(value) -> tuple[int, int, int, int, int, tuple[int, ...], CodecParams]:
    magic, version, code, ndim, csum, nbytes = _PREFIX.unpack_from(value, 0)
    if magic != MAGIC:
        raise CorruptValueError(f"bad magic {magic!r}")
    if version == 1:
        dims = _HEADER_V1.unpack_from(value, 0)[6:]
        return version, code, ndim, csum, nbytes, dims, CodecParams()
    if version != FORMAT_VERSION:
        raise CorruptValueError(f"value format version {version}, expected one of {READ_VERSIONS}")
    fields = _HEADER.unpack_from(value, 0)
    dims = fields[6:11]
    codec_code, flags, reserved, kgt, kgd, vgt, vgd, n = fields[11:]
    if codec_code not in layout.CODE_TO_CODEC or reserved:
        raise CorruptValueError(f"unknown codec code {codec_code}")
    codec = layout.CODE_TO_CODEC[codec_code]
    params = CodecParams(codec, flags, (kgt, kgd), (vgt, vgd), n)
    if codec == "none" and params != CodecParams():
        raise CorruptValueError(f"codec parameters {params} on a raw value")
    return version, code, ndim, csum, nbytes, dims, params


def decode_header(value) -> ValueHeader:
    """Parse and sanity-check the header of a stored value; raises :class:`CorruptValueError`."""
    if len(value) < HEADER_SIZE:
        raise CorruptValueError(f"value of {len(value)} bytes is shorter than the header")
    version, code, ndim, csum, nbytes, dims, params = _unpack(value)
    if code not in CODE_TO_DTYPE:
        raise CorruptValueError(f"unknown dtype code {code}")
    if not 1 <= ndim <= MAX_NDIM or any(dims[ndim:]):
        raise CorruptValueError(f"bad ndim {ndim} / shape {dims}")
    dtype = CODE_TO_DTYPE[code]
    shape = tuple(dims[:ndim])
    if params.codec == "none":
        expected = math.prod(shape) * dtype.itemsize
    else:
        try:
            expected = layout.payload_size(params, shape, dtype)
        except ValueError as e:
            raise CorruptValueError(f"bad codec parameters: {e}") from e
    if nbytes != expected or len(value) - HEADER_SIZE != nbytes:
        raise CorruptValueError(
            f"size mismatch: header says {nbytes} bytes, shape needs {expected}, "
            f"value holds {len(value) - HEADER_SIZE}"
        )
    return ValueHeader(dtype, shape, csum, nbytes, params, version)


def check_codec(header: ValueHeader, codec: str, location: object = "the store") -> None:
    """Raise :class:`CodecMismatchError` unless the value's codec is ``codec``."""
    if header.codec != codec:
        raise CodecMismatchError(
            f"{location} holds K/V of codec {codec!r}; this value is {header.codec!r}",
            header.codec,
            codec,
        )


def check_value(value, *, verify_checksum: bool = True, codec: str | None = None) -> ValueHeader:
    """Header check plus (optionally) the checksum, and with ``codec`` the value's codec
    (:class:`CodecMismatchError` otherwise); returns the header."""
    header = decode_header(value)
    if codec is not None:
        check_codec(header, codec)
    if verify_checksum:
        got = value_checksum(value, header.version)
        if got != header.checksum:
            raise CorruptValueError(f"checksum mismatch: stored {header.checksum:#x}, got {got:#x}")
    return header


def payload_view(buf) -> torch.Tensor:
    """Zero-copy uint8 tensor over a (read-only) buffer's payload."""
    with warnings.catch_warnings():
        # LMDB's map is read-only; torch warns that it cannot make the tensor read-only too.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8, offset=HEADER_SIZE)


def decode_payload(payload: torch.Tensor, header: ValueHeader) -> torch.Tensor | EncodedKV:
    """The stored value over a uint8 ``payload`` tensor (the bytes after the header) without a
    copy: the raw tensor (codec ``none``) or the :class:`EncodedKV` whose tensors view it."""
    if header.codec == "none":
        return payload.view(header.dtype).view(header.shape)
    enc = layout.read_payload(payload, header.params, header.shape, header.dtype)
    if enc.outlier_heads is not None:  # a bool view of bytes other than 0 and 1 is undefined
        codes = enc.outlier_heads.view(torch.uint8)
        if bool((codes > 1).any()) or int(codes.sum()) != header.params.num_outliers:
            raise CorruptValueError("outlier head mask does not match its count")
    return enc


def decode_value(buf, header: ValueHeader) -> torch.Tensor | EncodedKV:
    """:func:`decode_payload` over a whole stored value ``buf`` (``check_value(buf)``'s
    ``header``); the result views ``buf``."""
    return decode_payload(payload_view(buf), header)


def check_out(out: torch.Tensor, header: ValueHeader) -> None:
    """ValueError unless ``out`` has the stored value's decoded shape and dtype."""
    if tuple(out.shape) != header.shape or out.dtype != header.dtype:
        raise ValueError(
            f"out is {out.dtype}{tuple(out.shape)}, stored {header.dtype}{header.shape}"
        )
