"""How much disk chunk K/V takes: the projected size of an ingest, and the checks
that refuse a write the store's limit or the disk cannot hold (:class:`StoreFullError`).

A chunk's value is its K and V for every layer plus a fixed header, so the K/V of ``n`` new
tokens is known before any forward runs: ``n x num_layers x 2 x num_kv_heads x head_dim x``
the dtype's size (:func:`kv_bytes_per_token`) for a raw store; an ``int8`` or ``int4`` store
keeps the codes and their scales (:mod:`blendkv.store.codecs`), whose size the shape gives too
(``int4``: at most, since its outlier heads depend on the values).

An LMDB store's limit bounds its file (:class:`~blendkv.store.kv_store.KVStore`): the file
holds values in whole pages (:func:`value_pages`) and keeps a reserve of free pages
(:func:`reserve_pages`), so an ingest is checked against the file, not only the values.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from blendkv.errors import ConfigError
from blendkv.sizes import format_size, parse_size

from .codecs import INT4_KEY_GT, INT4_MAX_OUTLIER_FRACTION, INT4_VALUE_GD
from .codecs_layout import FLAG_K_ZERO, FLAG_OUTLIERS, FLAG_V_ZERO, CodecParams, payload_size
from .errors import StoreFullError
from .fingerprint import ModelFingerprint
from .format import HEADER_SIZE

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The request cache's default: what stays small on any disk a server runs on.
REQUEST_CACHE_MAX_DEFAULT = 2 << 30
REQUEST_CACHE_DISK_FRACTION = 0.10
# Room the disk keeps beside a projected ingest (LMDB pages, the index, the catalog).
DISK_HEADROOM = 1.10
# LMDB's own pages (two meta pages, each database's root, the B-tree pages a write copies) need
# room beside the values: a file bound below this is raised to it.
MIN_FILE_BYTES = 1 << 20
# The free pages a bounded store keeps: a share of its map, and never fewer than an eviction
# may copy (B-tree pages of every database) before it frees any.
RESERVE_FRACTION = 1 / 32
MIN_FREE_PAGES = 64


def file_limit(max_bytes: int) -> int:
    """The LMDB map size, so the largest file, of a store bounded by ``max_bytes``."""
    return max(max_bytes, MIN_FILE_BYTES)


def value_pages(nbytes: int, page_size: int) -> float:
    """Pages a value of ``nbytes`` takes in LMDB: overflow pages (with their 16-byte header)
    for one larger than about half a page, else its share of a leaf page."""
    if nbytes <= page_size // 2:
        return nbytes / page_size
    return -(-(nbytes + 16) // page_size)


def reserve_pages(map_pages: int) -> int:
    """Free pages a bounded store keeps beside its writes: the next eviction copies B-tree
    pages before it frees any, and a value of several pages needs a run of free ones."""
    return int(max(MIN_FREE_PAGES, map_pages * RESERVE_FRACTION))


def kv_bytes_per_token(fingerprint: ModelFingerprint) -> int:
    """Stored K/V bytes of one token for the model ``fingerprint`` names."""
    itemsize = _DTYPE_BYTES.get(fingerprint.dtype, 4)
    return fingerprint.num_layers * 2 * fingerprint.num_kv_heads * fingerprint.head_dim * itemsize


def value_bytes(fingerprint: ModelFingerprint, num_tokens: int) -> int:
    """Stored bytes of one chunk of ``num_tokens`` tokens in the store's codec, header included
    (``int4``: the most, with as many outlier heads as the encoder keeps)."""
    codec = fingerprint.kv_codec
    if codec == "none":
        return kv_bytes_per_token(fingerprint) * num_tokens + HEADER_SIZE
    import torch

    L, H, D = fingerprint.num_layers, fingerprint.num_kv_heads, fingerprint.head_dim
    if codec == "int8":
        groups, outliers = ((num_tokens, 1), (1, D)), 0
    else:
        groups = ((INT4_KEY_GT, 1), (1, min(INT4_VALUE_GD, D)))
        outliers = max(1, int(INT4_MAX_OUTLIER_FRACTION * L * H))
    flags = FLAG_K_ZERO | FLAG_V_ZERO | (FLAG_OUTLIERS if outliers else 0)
    params = CodecParams(codec, flags, groups[0], groups[1], outliers)
    dtype = getattr(torch, fingerprint.dtype, torch.float32)
    return HEADER_SIZE + payload_size(params, (L, 2, num_tokens, H, D), dtype)


def projected_bytes(fingerprint: ModelFingerprint, chunk_lengths: Sequence[int]) -> int:
    """Stored bytes of new chunks of ``chunk_lengths`` tokens (K/V plus each value's header)."""
    return sum(value_bytes(fingerprint, n) for n in chunk_lengths)


def free_disk(path: str | os.PathLike) -> int:
    """Free bytes on the disk that holds ``path`` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


class IngestPlan(NamedTuple):
    """What an ingest is about to write, and where it must fit (checked before any write)."""

    location: str
    num_tokens: int
    projected: int  # bytes of the new chunks' values
    max_bytes: int | None  # the store's limit
    stored: int  # bytes stored now
    evictable: int  # of which no document owns (the LRU may evict them)
    free: int | None  # free bytes on the store's disk (None: a Redis store)
    # A bounded LMDB store: the bound of its file (file_limit), the bytes the new values take
    # there (whole pages) and the bytes of it the store keeps free (reserve_pages).
    file_bytes: int | None = None
    in_file: int = 0
    reserve: int = 0

    def describe(self) -> str:
        """``projected K/V: 2.3 GiB for 12,345 tokens (store limit 20.0 GiB, 1.2 GiB used;
        free disk 80.1 GiB)``."""
        limit = "none" if self.max_bytes is None else format_size(self.max_bytes)
        disk = "" if self.free is None else f"; free disk {format_size(self.free)}"
        return (
            f"projected K/V: {format_size(self.projected)} for {self.num_tokens:,} tokens "
            f"(store limit {limit}, {format_size(self.stored)} used{disk})"
        )

    def check(self) -> None:
        """Raise :class:`StoreFullError` if the new K/V cannot fit the limit (after evicting
        what no document owns) or the free disk."""
        held = self.stored - self.evictable
        if self.max_bytes is not None and held + self.projected > self.max_bytes:
            raise StoreFullError(
                f"store {self.location}: {format_size(self.projected)} of new K/V does not "
                f"fit its limit of {format_size(self.max_bytes)} ({format_size(held)} held by "
                "documents); raise the limit (--store-max-bytes, store_max_bytes=), delete "
                "documents (blendkv docs delete) or ingest less"
            )
        if self.file_bytes is not None and held + self.in_file + self.reserve > self.file_bytes:
            raise StoreFullError(
                f"store {self.location}: {format_size(self.projected)} of new K/V "
                f"({format_size(self.in_file)} in whole pages) does not fit its limit of "
                f"{format_size(self.file_bytes)} on disk ({format_size(held)} held by "
                f"documents, {format_size(self.reserve)} kept free for its writes); raise "
                "the limit (--store-max-bytes, store_max_bytes=), delete documents (blendkv "
                "docs delete) or ingest less"
            )
        if self.free is not None and self.projected * DISK_HEADROOM > self.free:
            raise StoreFullError(
                f"store {self.location}: {format_size(self.projected)} of new K/V does not fit "
                f"the {format_size(self.free)} free on its disk; free space, ingest less, or "
                "put the store on another disk"
            )


def plan_ingest(kv, chunk_lengths: Sequence[int]) -> IngestPlan:
    """The :class:`IngestPlan` of writing new chunks of ``chunk_lengths`` tokens into ``kv``
    (a :class:`~blendkv.store.base.ChunkKVStore`)."""
    stats = kv.stats()
    lmdb = kv.tier == "lmdb"
    bounded = lmdb and stats.max_bytes is not None
    file_bytes, in_file, reserve = None, 0, 0
    if bounded:
        page, file_bytes = kv.page_size, file_limit(stats.max_bytes)
        fp = kv.fingerprint
        pages = sum(value_pages(value_bytes(fp, n), page) for n in chunk_lengths)
        in_file = int(pages * page)
        reserve = reserve_pages(file_bytes // page) * page
    return IngestPlan(
        location=str(kv.path),
        num_tokens=sum(chunk_lengths),
        projected=projected_bytes(kv.fingerprint, chunk_lengths),
        max_bytes=stats.max_bytes,
        stored=stats.bytes,
        evictable=kv.evictable_bytes() if bounded else 0,
        free=free_disk(kv.path) if lmdb else None,
        file_bytes=file_bytes,
        in_file=in_file,
        reserve=reserve,
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
