"""The LMDB databases of a store and the small records inside them.

=========  ==============================  ===========================================
database   key                             value
=========  ==============================  ===========================================
store      b"format", b"fingerprint",      JSON / JSON / u64 little-endian counters
           b"next_chunk_id", b"total_bytes",
           b"lru_clock", b"evictions"
           b"max_bytes" (optional)         the byte limit in ASCII digits
values     chunk key (16 bytes)            header + tensor bytes (see ``format.py``)
chunks     chunk key                       ChunkMeta JSON
ids        chunk id, u64 big-endian        chunk key
usage      chunk key                       (lru seq u64, last-used time f64) little-endian
lru        lru seq, u64 big-endian         chunk key  (first entry = least recently used)
docs       doc_id utf-8 + NUL + id (u64 BE) chunk key
=========  ==============================  ===========================================

Big-endian integers in keys make LMDB's byte order equal numeric order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

STORE_KIND = "blendkv.store"
STORE_FORMAT_VERSION = 1
DB_NAMES = ("store", "values", "chunks", "ids", "usage", "lru", "docs")

_U64 = struct.Struct("<Q")
_BE64 = struct.Struct(">Q")
_USAGE = struct.Struct("<Qd")


def format_record() -> bytes:
    return json.dumps({"kind": STORE_KIND, "version": STORE_FORMAT_VERSION}).encode()


def be64(n: int) -> bytes:
    return _BE64.pack(n)


def from_be64(b) -> int:
    return _BE64.unpack(bytes(b))[0]


def pack_usage(seq: int, last_used: float) -> bytes:
    return _USAGE.pack(seq, last_used)


def unpack_usage(b) -> tuple[int, float]:
    return _USAGE.unpack(bytes(b))


def doc_prefix(doc_id: str) -> bytes:
    return doc_id.encode() + b"\x00"


def doc_entry(doc_id: str, chunk_id: int) -> bytes:
    return doc_prefix(doc_id) + be64(chunk_id)


@dataclass
class Counters:
    """Store-wide counters, read at the start of a write transaction and written at its end."""

    next_chunk_id: int = 0
    total_bytes: int = 0
    lru_clock: int = 0
    evictions: int = 0

    _FIELDS = ("next_chunk_id", "total_bytes", "lru_clock", "evictions")

    @classmethod
    def read(cls, txn, db) -> Counters:
        values = {}
        for name in cls._FIELDS:
            raw = txn.get(name.encode(), db=db)
            values[name] = _U64.unpack(bytes(raw))[0] if raw is not None else 0
        return cls(**values)

    def write(self, txn, db) -> None:
        for name in self._FIELDS:
            txn.put(name.encode(), _U64.pack(getattr(self, name)), db=db)
