"""The write operations inside one LMDB write transaction: insert, touch, evict, delete.

Each keeps all databases of :mod:`layout` and the :class:`layout.Counters` in step; the caller
commits them together, so no reader ever sees a partial entry.
"""

from __future__ import annotations

import dataclasses

from . import layout
from .layout import Counters
from .records import ChunkMeta, NewChunk


def touch(txn, dbs: dict, counters: Counters, key: bytes, when: float) -> bool:
    """Make ``key`` the most recently used chunk; False if it is not stored."""
    usage = txn.get(key, db=dbs["usage"])
    if usage is None:
        return False
    old_seq, _ = layout.unpack_usage(usage)
    txn.delete(layout.be64(old_seq), db=dbs["lru"])
    counters.lru_clock += 1
    txn.put(layout.be64(counters.lru_clock), key, db=dbs["lru"])
    txn.put(key, layout.pack_usage(counters.lru_clock, when), db=dbs["usage"])
    return True


def insert(txn, dbs: dict, counters: Counters, chunk: NewChunk, value, now: float) -> int:
    """Write a new chunk (value, metadata, id, LRU, document entry); returns its chunk id."""
    cid = counters.next_chunk_id
    counters.next_chunk_id += 1
    meta = ChunkMeta.for_new(chunk, cid, len(value), now)
    txn.put(chunk.key, value, db=dbs["values"])
    txn.put(chunk.key, meta.to_json(), db=dbs["chunks"])
    txn.put(layout.be64(cid), chunk.key, db=dbs["ids"])
    counters.lru_clock += 1
    txn.put(layout.be64(counters.lru_clock), chunk.key, db=dbs["lru"])
    txn.put(chunk.key, layout.pack_usage(counters.lru_clock, now), db=dbs["usage"])
    if chunk.doc_id is not None:
        txn.put(layout.doc_entry(chunk.doc_id, cid), chunk.key, db=dbs["docs"])
    counters.total_bytes += len(value)
    return cid


def delete(txn, dbs: dict, counters: Counters, key: bytes) -> int | None:
    """Remove a chunk from every database; returns its chunk id, None if absent."""
    raw = txn.get(key, db=dbs["chunks"])
    if raw is None:
        return None
    meta = ChunkMeta.from_json(raw)
    value = txn.get(key, db=dbs["values"])
    if value is not None:
        counters.total_bytes -= len(value)
        txn.delete(key, db=dbs["values"])
    usage = txn.get(key, db=dbs["usage"])
    if usage is not None:
        txn.delete(layout.be64(layout.unpack_usage(usage)[0]), db=dbs["lru"])
        txn.delete(key, db=dbs["usage"])
    txn.delete(key, db=dbs["chunks"])
    txn.delete(layout.be64(meta.chunk_id), db=dbs["ids"])
    if meta.doc_id is not None:
        txn.delete(layout.doc_entry(meta.doc_id, meta.chunk_id), db=dbs["docs"])
    return meta.chunk_id


def reassign(txn, dbs: dict, key: bytes, doc_id: str, position: int) -> bool:
    """Make ``doc_id`` the owner of a stored chunk, at ``position`` of it (its metadata and the
    document index); False if the chunk is not stored."""
    raw = txn.get(key, db=dbs["chunks"])
    if raw is None:
        return False
    meta = ChunkMeta.from_json(raw)
    if meta.doc_id is not None:
        txn.delete(layout.doc_entry(meta.doc_id, meta.chunk_id), db=dbs["docs"])
    meta = dataclasses.replace(meta, doc_id=doc_id, position=position)
    txn.put(key, meta.to_json(), db=dbs["chunks"])
    txn.put(layout.doc_entry(doc_id, meta.chunk_id), key, db=dbs["docs"])
    return True


def evictable(raw_meta) -> bool:
    """Whether a chunk (its ChunkMeta JSON) may be evicted: only chunks no document owns (K/V
    computed at query time). The compact JSON spells a missing owner exactly so, and a quote
    inside a string value is escaped, so the byte test cannot match the chunk's text."""
    return b'"doc_id":null' in bytes(raw_meta)


def evict(
    txn, dbs: dict, counters: Counters, max_bytes: int | None, protected: set[bytes]
) -> list[tuple[bytes, int]]:
    """Delete least-recently-used evictable chunks (:func:`evictable`, never ``protected``
    ones) until under ``max_bytes``; the caller checks whether that sufficed.

    Returns ``(key, chunk_id)`` of each evicted chunk, oldest first.
    """
    if max_bytes is None or counters.total_bytes <= max_bytes:
        return []
    victims, freed = [], 0
    for _, key in txn.cursor(db=dbs["lru"]):
        if counters.total_bytes - freed <= max_bytes:
            break
        key = bytes(key)
        if key not in protected and evictable(txn.get(key, db=dbs["chunks"])):
            victims.append(key)
            freed += len(txn.get(key, db=dbs["values"]))
    evicted = []
    for key in victims:
        cid = delete(txn, dbs, counters, key)
        evicted.append((key, cid))
        counters.evictions += 1
    return evicted
