"""The chunk-K/V store interface the blend manager and the RAG pipeline use.

Two backends serve it: :class:`~blendkv.store.KVStore` (LMDB, the embedded default) and
:class:`~blendkv.store.redis_store.RedisKVStore` (one store for many engine processes). Open
either with ``KVStore.open(location, fingerprint)``. Values are the same bytes in both (64-byte
header + raw tensor + xxh3 checksum); keys are content-addressed (``chunk_key``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from .fingerprint import ModelFingerprint
from .records import ChunkKV, ChunkMeta, NewChunk, PutResult, StoreStats, VerifyReport


@runtime_checkable
class ChunkKVStore(Protocol):
    fingerprint: ModelFingerprint
    connection_errors: int  # lost connections so far (LMDB: always 0)
    tier: str  # "lmdb" or "redis": where a read that misses the memory tier goes
    pin_memory: bool  # allocate values read from storage in pinned host memory (CUDA)

    def get(self, key: bytes, *, skip_memory_tier: bool = False) -> ChunkKV | None:
        """A chunk's K/V (read-only tensor), or None on a miss or a corrupt value.
        ``skip_memory_tier``: read from storage even if the memory tier holds it."""

    def read_into(self, key: bytes, out: torch.Tensor, *, admit: bool = False) -> bool:
        """Copy a chunk's K/V into ``out``; False on a miss or a corrupt value."""

    def put_many(self, chunks: Sequence[NewChunk]) -> list[PutResult]:
        """Store chunks; a reader never sees half a chunk."""

    def __contains__(self, key: bytes) -> bool: ...

    def delete(self, keys: Sequence[bytes]) -> list[int]: ...

    def delete_document(self, doc_id: str) -> list[int]: ...

    def meta_for_id(self, chunk_id: int) -> ChunkMeta | None: ...

    def document_chunks(self, doc_id: str) -> list[ChunkMeta]: ...

    def iter_meta(self) -> Iterator[ChunkMeta]: ...

    def stats(self) -> StoreStats: ...

    def verify(self) -> VerifyReport: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def open_kv_store(location, fingerprint: ModelFingerprint | None = None, **kwargs) -> ChunkKVStore:
    """A chunk-K/V store at ``location``: a ``redis://host:port/db`` URL opens a
    :class:`~blendkv.store.redis_store.RedisKVStore`, anything else an LMDB directory
    (:class:`~blendkv.store.KVStore`). LMDB-only options are dropped for Redis."""
    from .kv_store import KVStore
    from .redis_store import RedisKVStore, is_redis_url

    if is_redis_url(location):
        for name in ("map_size", "verify_reads", "sync"):
            kwargs.pop(name, None)
        return RedisKVStore(location, fingerprint, **kwargs)
    return KVStore(location, fingerprint, **kwargs)


def locked(method):
    """Run ``method`` holding ``self._lock`` (re-entrant: locked methods call each other)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper
