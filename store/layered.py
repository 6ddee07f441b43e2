"""A chunk-K/V store read in two layers: the documents' store, then a bounded request cache.

The server blends documents that clients send in requests. Their K/V is computed at query time
and is worth keeping for the next request with the same documents, but it must neither grow the
RAG store nor fill the disk: :class:`LayeredKVStore` writes every chunk no document owns
(``doc_id`` None) into ``cache``, a private LMDB store with a byte limit whose LRU evicts freely,
and every document chunk into ``main``. Reads look in ``main`` first, then in ``cache``.

It implements :class:`~blendkv.store.base.ChunkKVStore`, so the blend loader, the prefetcher and
the background writer use it as they use one store. Metadata, stats and verify are ``main``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .base import ChunkKVStore, StoreSnapshot, fill_misses
from .fingerprint import ModelFingerprint
from .memory_tier import MemoryTier
from .records import ChunkKV, ChunkMeta, NewChunk, PutResult, StoreStats, VerifyReport


class LayeredSnapshot:
    """Read snapshots of both layers, viewed in the store's order."""

    def __init__(self, main: StoreSnapshot, cache: StoreSnapshot) -> None:
        self.main, self.cache = main, cache

    def view(self, key: bytes) -> ChunkKV | None:
        found = self.main.view(key)
        return found if found is not None else self.cache.view(key)

    def view_encoded(self, key: bytes):
        found = self.main.view_encoded(key)
        return found if found is not None else self.cache.view_encoded(key)

    def warm(self, key: bytes) -> bool:
        return self.main.warm(key) or self.cache.warm(key)

    def close(self) -> None:
        self.main.close()
        self.cache.close()


class LayeredKVStore:
    """``main`` (documents) read before ``cache`` (K/V computed at query time, bounded)."""

    def __init__(self, main: ChunkKVStore, cache: ChunkKVStore) -> None:
        assert cache.max_bytes is not None, "the request cache must be bounded"
        self.main, self.cache = main, cache

    # ---- what the protocol reads as attributes ---------------------------------------------
    @property
    def fingerprint(self) -> ModelFingerprint:
        return self.main.fingerprint

    @property
    def connection_errors(self) -> int:
        return self.main.connection_errors + self.cache.connection_errors

    @property
    def tier(self) -> str:
        return self.main.tier

    @property
    def memory_tier(self) -> MemoryTier:
        return self.main.memory_tier

    @property
    def reads_in_place(self) -> bool:
        return self.main.reads_in_place and self.cache.reads_in_place

    @property
    def pin_memory(self) -> bool:
        return self.main.pin_memory

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        self.main.pin_memory = self.cache.pin_memory = value

    # ---- reads: main first -----------------------------------------------------------------
    def get(self, key: bytes, *, skip_memory_tier: bool = False) -> ChunkKV | None:
        found = self.main.get(key, skip_memory_tier=skip_memory_tier)
        return found if found is not None else self.cache.get(key)

    @property
    def kv_codec(self) -> str:
        return self.main.kv_codec

    def get_encoded(self, key: bytes, *, skip_memory_tier: bool = False):
        found = self.main.get_encoded(key, skip_memory_tier=skip_memory_tier)
        return found if found is not None else self.cache.get_encoded(key)

    def read_into(self, key: bytes, out: torch.Tensor, *, admit: bool = False) -> bool:
        return self.main.read_into(key, out, admit=admit) or self.cache.read_into(key, out)

    def warm(self, key: bytes) -> bool:
        return self.main.warm(key) or self.cache.warm(key)

    def snapshot(self) -> LayeredSnapshot | None:
        main = self.main.snapshot()
        if main is None:
            return None
        cache = self.cache.snapshot()
        if cache is None:
            main.close()
            return None
        return LayeredSnapshot(main, cache)

    def __contains__(self, key: bytes) -> bool:
        return key in self.main or key in self.cache

    def contains_many(self, keys) -> list[bool]:
        return fill_misses(self.main.contains_many(keys), keys, self.cache.contains_many)

    # ---- writes: document chunks to main, the rest to the cache ----------------------------
    def put_many(self, chunks: Sequence[NewChunk]) -> list[PutResult]:
        owned = [i for i, c in enumerate(chunks) if c.doc_id is not None]
        loose = [i for i, c in enumerate(chunks) if c.doc_id is None]
        results: list[PutResult | None] = [None] * len(chunks)
        for store, idx in ((self.main, owned), (self.cache, loose)):
            if idx:
                for i, r in zip(idx, store.put_many([chunks[i] for i in idx]), strict=True):
                    results[i] = r
        return results  # type: ignore[return-value]

    def delete(self, keys: Sequence[bytes]) -> list[int]:
        self.cache.delete(keys)
        return self.main.delete(keys)  # chunk ids are main's (the cache's are its own)

    def delete_document(self, doc_id: str) -> list[int]:
        return self.main.delete_document(doc_id)

    def reassign(self, moves: Sequence[tuple[bytes, str, int]]) -> int:
        return self.main.reassign(moves)

    # ---- metadata and health: main's --------------------------------------------------------
    def meta_for_id(self, chunk_id: int) -> ChunkMeta | None:
        return self.main.meta_for_id(chunk_id)

    def document_chunks(self, doc_id: str) -> list[ChunkMeta]:
        return self.main.document_chunks(doc_id)

    def iter_meta(self) -> Iterator[ChunkMeta]:
        return self.main.iter_meta()

    def stats(self) -> StoreStats:
        return self.main.stats()

    def verify(self) -> VerifyReport:
        return self.main.verify()

    def flush(self) -> None:
        self.main.flush()
        self.cache.flush()

    def close(self) -> None:
        self.cache.close()
        self.main.close()
