"""Binary layout of one stored chunk K/V value: a fixed 64-byte header, then raw tensor bytes.

::

    offset  size  field
    0       4     magic  b"BKVC"
    4       2     format version (u16)
    6       1     dtype code (u8): 1 float32, 2 bfloat16, 3 float16
    7       1     ndim (u8, 1..5)
    8       8     checksum: xxh3_64 of the payload (u64)
    16      8     payload size in bytes (u64)
    24      40    shape, 5 x u64 (unused dims are 0)
    64      ...   payload: the tensor's bytes, C order, little-endian

All integers are little-endian. The header is 64 bytes so the payload keeps the alignment of
LMDB's page-aligned overflow pages, which lets ``torch.frombuffer`` view it without a copy.
No pickle and no ``torch.load``: a value is only ever interpreted as numbers.
"""

from __future__ import annotations

import math
import struct
import warnings
from typing import NamedTuple

import torch
import xxhash

from .errors import CorruptValueError

MAGIC = b"BKVC"
FORMAT_VERSION = 1
HEADER_SIZE = 64
MAX_NDIM = 5

_HEADER = struct.Struct("<4sHBBQQ5Q")
assert _HEADER.size == HEADER_SIZE

DTYPE_TO_CODE: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_TO_DTYPE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_TO_CODE.items()}


class ValueHeader(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    checksum: int
    nbytes: int


def checksum(payload) -> int:
    """xxh3_64 of a bytes-like payload (any object with the buffer protocol)."""
    return xxhash.xxh3_64_intdigest(payload)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes as a flat memoryview (copies only if not contiguous or on a GPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def encode_header(dtype: torch.dtype, shape: tuple[int, ...], payload) -> bytes:
    if dtype not in DTYPE_TO_CODE:
        raise ValueError(f"unsupported dtype {dtype}; use one of {list(DTYPE_TO_CODE)}")
    if not 1 <= len(shape) <= MAX_NDIM:
        raise ValueError(f"tensor must have 1..{MAX_NDIM} dims, got shape {tuple(shape)}")
    nbytes = len(payload)
    dims = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    return _HEADER.pack(
        MAGIC, FORMAT_VERSION, DTYPE_TO_CODE[dtype], len(shape), checksum(payload), nbytes, *dims
    )


def encode_value(tensor: torch.Tensor) -> bytearray:
    """Header plus payload in one buffer (one copy of the tensor's bytes)."""
    payload = tensor_bytes(tensor)
    header = encode_header(tensor.dtype, tuple(tensor.shape), payload)
    buf = bytearray(HEADER_SIZE + len(payload))
    buf[:HEADER_SIZE] = header
    buf[HEADER_SIZE:] = payload
    return buf


def decode_header(value) -> ValueHeader:
    """Parse and sanity-check the header of a stored value; raises :class:`CorruptValueError`."""
    if len(value) < HEADER_SIZE:
        raise CorruptValueError(f"value of {len(value)} bytes is shorter than the header")
    magic, version, code, ndim, csum, nbytes, *dims = _HEADER.unpack_from(value, 0)
    if magic != MAGIC:
        raise CorruptValueError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptValueError(f"value format version {version}, expected {FORMAT_VERSION}")
    if code not in CODE_TO_DTYPE:
        raise CorruptValueError(f"unknown dtype code {code}")
    if not 1 <= ndim <= MAX_NDIM or any(dims[ndim:]):
        raise CorruptValueError(f"bad ndim {ndim} / shape {dims}")
    dtype = CODE_TO_DTYPE[code]
    shape = tuple(dims[:ndim])
    expected = math.prod(shape) * dtype.itemsize
    if nbytes != expected or len(value) - HEADER_SIZE != nbytes:
        raise CorruptValueError(
            f"size mismatch: header says {nbytes} bytes, shape needs {expected}, "
            f"value holds {len(value) - HEADER_SIZE}"
        )
    return ValueHeader(dtype, shape, csum, nbytes)


def check_value(value, *, verify_checksum: bool = True) -> ValueHeader:
    """Header check plus (optionally) the payload checksum; returns the header."""
    header = decode_header(value)
    if verify_checksum:
        got = checksum(memoryview(value)[HEADER_SIZE:])
        if got != header.checksum:
            raise CorruptValueError(f"checksum mismatch: stored {header.checksum:#x}, got {got:#x}")
    return header


def payload_view(buf) -> torch.Tensor:
    """Zero-copy uint8 tensor over a (read-only) buffer's payload."""
    with warnings.catch_warnings():
        # LMDB's map is read-only; torch warns that it cannot make the tensor read-only too.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8, offset=HEADER_SIZE)
