"""The chunk-K/V store protocol: what the blend loader, the prefetcher and the RAG pipeline call.

Two backends implement it: :class:`~blendkv.store.KVStore` (LMDB, the embedded default) and
:class:`~blendkv.store.redis_store.RedisKVStore` (one store for many engine processes). Open
either with :func:`~blendkv.store.backends.open_kv_store`. Values are the same bytes in both
(64-byte header + raw tensor + xxh3 checksum); keys are content-addressed (``chunk_key``).

Every backend has every method. What a backend cannot do it says through the protocol
(:attr:`ChunkKVStore.reads_in_place`, a ``None`` or ``False`` result), so callers never probe
for methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from .codecs import EncodedKV
from .fingerprint import ModelFingerprint
from .memory_tier import MemoryTier
from .records import ChunkKV, ChunkMeta, NewChunk, PutResult, StoreStats, VerifyReport


def fill_misses(
    found: list[bool], keys: Sequence[bytes], second: Callable[[list[bytes]], list[bool]]
) -> list[bool]:
    """``found`` (a first source's answer for each key) completed by ``second`` (a second
    source's ``contains_many``) for the keys the first missed, asked once, in place."""
    ask = [i for i, hit in enumerate(found) if not hit]
    if ask:
        for i, hit in zip(ask, second([keys[i] for i in ask]), strict=True):
            found[i] = hit
    return found


class StoreSnapshot(Protocol):
    """A read transaction held open across threads until :meth:`close`: values viewed through
    it stay valid (and are not written) until then, even if a concurrent write evicts them."""

    def view(self, key: bytes) -> ChunkKV | None:
        """The chunk's K/V as a zero-copy, read-only tensor; None on a miss or a corrupt
        value."""

    def view_encoded(self, key: bytes) -> torch.Tensor | EncodedKV | None:
        """The chunk's value as stored, zero-copy (a tensor for codec ``none``, else an
        :class:`~blendkv.store.codecs.EncodedKV` viewing the map); None on a miss."""

    def warm(self, key: bytes) -> bool:
        """Fault the value into memory ahead of its use; False on a miss or a corrupt value."""

    def close(self) -> None:
        """End the transaction; views taken through it must no longer be used."""


@runtime_checkable
class ChunkKVStore(Protocol):
    """A store of chunk K/V by content-addressed key: what :func:`open_kv_store` returns
    (:class:`~blendkv.store.KVStore` over LMDB, or a Redis store).

    Reads never raise for a missing or corrupt value: they return None or False, and a
    corrupt value is dropped. Writes are atomic per call.

    Attributes:
        fingerprint: the model fingerprint the store was built for.
        connection_errors: lost connections so far (LMDB: always 0).
        tier: "lmdb" or "redis": where a read that misses the memory tier goes.
        pin_memory: values read from storage are allocated in pinned host memory (CUDA).
        memory_tier: the in-RAM LRU of hot chunks in front of storage.
        reads_in_place: True when values are read in place from a memory map (LMDB):
            :meth:`snapshot` views them without a copy and :meth:`warm` faults them into the OS
            page cache. False (Redis): values are read whole by :meth:`get` /
            :meth:`read_into`, ``snapshot`` is None, ``warm`` a no-op.
        kv_codec: how values are encoded (:mod:`blendkv.store.codecs`): "none", "int8" or
            "int4".
    """

    fingerprint: ModelFingerprint
    connection_errors: int
    tier: str
    pin_memory: bool
    memory_tier: MemoryTier
    reads_in_place: bool

    kv_codec: str

    def get(self, key: bytes, *, skip_memory_tier: bool = False) -> ChunkKV | None:
        """A chunk's K/V (read-only tensor, decoded), or None on a miss or a corrupt value.
        ``skip_memory_tier``: read from storage even if the memory tier holds it."""

    def get_encoded(
        self, key: bytes, *, skip_memory_tier: bool = False
    ) -> torch.Tensor | EncodedKV | None:
        """A chunk's value as stored: the raw tensor (codec ``none``) or its
        :class:`~blendkv.store.codecs.EncodedKV`, for a loader that decodes while it writes
        the pool; None on a miss or a corrupt value. Read-only."""

    def read_into(self, key: bytes, out: torch.Tensor, *, admit: bool = False) -> bool:
        """Copy a chunk's K/V into ``out`` (the stored shape and dtype, any device); False on a
        miss or a corrupt value. ``admit``: also keep a copy in the memory tier."""

    def warm(self, key: bytes) -> bool:
        """Bring a chunk's value closer ahead of its use (LMDB: into the OS page cache) without
        holding the store's lock while storage reads. False on a miss, a corrupt value, or when
        the store has nothing to warm (``reads_in_place`` is False)."""

    def snapshot(self) -> StoreSnapshot | None:
        """A read transaction to view values through, from any thread, until it is closed.
        None when the store cannot view values in place (``reads_in_place`` is False) or cannot
        right now (read with :meth:`get` then)."""

    def put_many(self, chunks: Sequence[NewChunk]) -> list[PutResult]:
        """Store chunks; a reader never sees half a chunk."""

    def __contains__(self, key: bytes) -> bool: ...

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``key in self`` for each key, in one read (Redis: one round trip)."""

    def delete(self, keys: Sequence[bytes]) -> list[int]:
        """Delete chunks by key in one write; returns the chunk ids that were stored."""

    def delete_document(self, doc_id: str) -> list[int]:
        """Delete every chunk ``doc_id`` owns; returns their chunk ids."""

    def reassign(self, moves: Sequence[tuple[bytes, str, int]]) -> int:
        """Give stored chunks a new owner document and position: ``(key, doc_id, position)``
        each; returns how many were stored."""

    def meta_for_id(self, chunk_id: int) -> ChunkMeta | None:
        """The metadata of the chunk with this id; None when it is not stored."""

    def document_chunks(self, doc_id: str) -> list[ChunkMeta]:
        """The metadata of ``doc_id``'s chunks, by position."""

    def iter_meta(self) -> Iterator[ChunkMeta]:
        """The metadata of every stored chunk."""

    def stats(self) -> StoreStats:
        """The store's counters."""

    def verify(self) -> VerifyReport:
        """Check every value (header, checksum) and the metadata's agreement with them."""

    def flush(self) -> None:
        """Write pending LRU touches (reads batch them)."""

    def close(self) -> None:
        """Close the store (LMDB writes its pending LRU touches first)."""
