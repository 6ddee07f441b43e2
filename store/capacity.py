"""How much disk chunk K/V takes: human sizes, the projected size of an ingest, and the checks
that refuse a write the store's limit or the disk cannot hold (:class:`StoreFullError`).

A chunk's value is its K and V for every layer plus a fixed header, so the K/V of ``n`` new
tokens is known before any forward runs: ``n x num_layers x 2 x num_kv_heads x head_dim x``
the dtype's size (:func:`kv_bytes_per_token`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from blendkv.errors import ConfigError

from .errors import StoreFullError
from .fingerprint import ModelFingerprint
from .format import HEADER_SIZE

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
# The request cache's default: what stays small on any disk a server runs on.
REQUEST_CACHE_MAX_DEFAULT = 2 << 30
REQUEST_CACHE_DISK_FRACTION = 0.10
# Room the disk keeps beside a projected ingest (LMDB pages, the index, the catalog).
DISK_HEADROOM = 1.10


def parse_size(text: str | int) -> int:
    """Bytes from a human size: ``"20G"``, ``"500M"``, ``"1.5GiB"``, ``"4096"`` (binary
    units: K = 1024). Raises ``ValueError`` on anything else or on zero."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        if match is None:
            raise ValueError(f"not a size: {text!r} (e.g. 500M, 20G, 4096)")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def format_size(n: int | float) -> str:
    """``n`` bytes for a person: ``"2.3 GiB"``, ``"512 B"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def kv_bytes_per_token(fingerprint: ModelFingerprint) -> int:
    """Stored K/V bytes of one token for the model ``fingerprint`` names."""
    itemsize = _DTYPE_BYTES.get(fingerprint.dtype, 4)
    return fingerprint.num_layers * 2 * fingerprint.num_kv_heads * fingerprint.head_dim * itemsize


def projected_bytes(fingerprint: ModelFingerprint, chunk_lengths: Sequence[int]) -> int:
    """Stored bytes of new chunks of ``chunk_lengths`` tokens (K/V plus each value's header)."""
    per_token = kv_bytes_per_token(fingerprint)
    return sum(per_token * n + HEADER_SIZE for n in chunk_lengths)


def free_disk(path: str | os.PathLike) -> int:
    """Free bytes on the disk that holds ``path`` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_fits(
    path: str | os.PathLike, projected: int, stored: int, max_bytes: int | None, evictable: int
) -> None:
    """Refuse, before any write, ``projected`` new bytes that the store's limit (after evicting
    the ``evictable`` bytes no document owns) or the free disk cannot hold."""
    if max_bytes is not None and stored - evictable + projected > max_bytes:
        raise StoreFullError(
            f"store {path}: {format_size(projected)} of new K/V does not fit its limit of "
            f"{format_size(max_bytes)} ({format_size(stored - evictable)} held by documents); "
            "raise the limit (--store-max-bytes, store_max_bytes=) or delete documents "
            "(blendkv docs delete)"
        )
    free = free_disk(path)
    if projected * DISK_HEADROOM > free:
        raise StoreFullError(
            f"store {path}: {format_size(projected)} of new K/V does not fit the "
            f"{format_size(free)} free on its disk; free space, ingest less, or use a store "
            "on another disk"
        )


def store_full_error(path, max_bytes: int, total_bytes: int, encoded) -> StoreFullError:
    """The error of a write that, after every eviction allowed, leaves the store over its
    limit (the write is rolled back)."""
    new = sum(len(v) for v in encoded)
    return StoreFullError(
        f"store {path} is full: its limit is {format_size(max_bytes)} and documents hold "
        f"{format_size(total_bytes - new)}, so {format_size(new)} more does not fit; raise "
        "the limit (--store-max-bytes, store_max_bytes=) or delete documents "
        "(blendkv docs delete)"
    )


def default_request_cache_bytes(path: str | os.PathLike) -> int:
    """The server's request-document cache bound: 2 GiB or a tenth of the free disk at
    ``path``, whichever is smaller, so that a client cannot fill the disk."""
    fraction = int(free_disk(path) * REQUEST_CACHE_DISK_FRACTION)
    return max(1 << 20, min(REQUEST_CACHE_MAX_DEFAULT, fraction))


def store_max_bytes_arg(value: int | str | None) -> int | None:
    """A ``store_max_bytes`` argument (bytes, or a human size) as bytes; a bad one raises
    :class:`~blendkv.errors.ConfigError`."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise ConfigError(f"store_max_bytes: {e}") from e
