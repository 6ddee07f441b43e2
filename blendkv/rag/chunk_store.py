"""The store facade: K/V store and FAISS index kept in step.

Adds write the K/V (one LMDB transaction) and then index the new chunks; evictions and
removals delete from both. The index file lives beside the LMDB files
(``<store>/chunks.faiss``). If a process dies between the two steps, the next writable open
re-syncs the index from the store (:meth:`ChunkStore.sync_index`): ids the store lacks are
dropped, chunks the index lacks are re-embedded from their stored text.

Over Redis (``redis://`` location) FAISS stays per process: there is no index file; the
chunks' embeddings are kept in Redis beside them, so a process opening the store rebuilds its
index from them (no re-embedding), and a search first re-syncs when another process added or
deleted chunks since (Redis' generation counter).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from blendkv.rag.embedding import Embedder, MiniLMEmbedder
from blendkv.rag.index import ChunkIndex
from blendkv.store.backends import open_kv_store
from blendkv.store.fingerprint import ModelFingerprint
from blendkv.store.records import ChunkMeta, NewChunk, PutResult, VerifyReport
from blendkv.store.redis_store import is_redis_url

INDEX_FILE = "chunks.faiss"


@dataclass(frozen=True)
class SearchHit:
    """One result of :meth:`ChunkStore.search`.

    Attributes:
        chunk_id: the chunk's id in the store.
        score: the index similarity to the searched text (higher is closer).
        meta: the chunk's stored metadata (text, token ids, document, position).
    """

    chunk_id: int
    score: float
    meta: ChunkMeta


class ChunkStore:
    """Chunk K/V (:attr:`kv`) plus their embedding index (:attr:`index`).

    ``store_kwargs`` go to the store's backend (:func:`~blendkv.store.backends.open_kv_store`).
    A ``ChunkStore`` is a context manager; leaving it closes the K/V store.

    Attributes:
        embedder: the embedder of chunk texts (and of searched texts).
        kv: the :class:`~blendkv.store.ChunkKVStore` (LMDB or Redis) holding the chunks.
        shared: whether the store is a Redis one (embeddings kept in it, no index file).
        index_path: the FAISS index file (``<store>/chunks.faiss``); None for Redis.
        index: the chunk embedding index (:class:`~blendkv.rag.index.ChunkIndex`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        fingerprint: ModelFingerprint | None = None,
        embedder: Embedder | None = None,
        *,
        index_kind: str = "flat",
        readonly: bool = False,
        **store_kwargs,
    ) -> None:
        self.embedder = embedder if embedder is not None else MiniLMEmbedder()
        self.kv = open_kv_store(path, fingerprint, readonly=readonly, **store_kwargs)
        self.shared = is_redis_url(path)  # embeddings in the store, no index file
        self.index_path = None if self.shared else self.kv.path / INDEX_FILE
        self._generation = None
        try:
            if self.index_path is not None and self.index_path.exists():
                self.index = ChunkIndex.load(self.index_path, self.embedder.name, self.embedder.dim)
            else:
                self.index = ChunkIndex(self.embedder.dim, self.embedder.name, index_kind)
            if self.shared or (not readonly and not self.kv.inspect_only):
                self.sync_index()
        except BaseException:
            self.kv.close()
            raise

    def close(self) -> None:
        """Close the K/V store (the index is saved on every change)."""
        self.kv.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def save_index(self) -> None:
        """Write the index to its file (no-op for Redis stores)."""
        if self.index_path is not None:
            self.index.save(self.index_path)

    def add_chunks(self, chunks: Sequence[NewChunk]) -> list[PutResult]:
        """Store chunks (one transaction) and index the new ones; returns per-chunk results."""
        results = self.kv.put_many(chunks)
        # Only document chunks are retrievable; K/V written back at query time (no doc_id) is
        # a cache entry, kept out of the index.
        new = [
            (c, r.chunk_id)
            for c, r in zip(chunks, results, strict=True)
            if r.inserted and c.doc_id is not None
        ]
        evicted = [cid for r in results for cid in r.evicted]
        if evicted:
            self.index.remove(evicted)
        if new:
            vectors = self.embedder.embed([c.text for c, _ in new])
            self.index.add([cid for _, cid in new], vectors)
            if self.shared:
                self.kv.put_embeddings([c.key for c, _ in new], vectors)
        if new or evicted:
            self.save_index()
        return results

    def remove_document(self, doc_id: str) -> list[int]:
        """Delete every chunk of ``doc_id`` from store and index; returns their chunk ids."""
        removed = self.kv.delete_document(doc_id)
        if removed:
            self.index.remove(removed)
            self.save_index()
        return removed

    def remove_chunks(self, keys: Sequence[bytes]) -> list[int]:
        """Delete chunks by key from store and index; returns the chunk ids that were stored."""
        removed = self.kv.delete(list(keys)) if keys else []
        if removed:
            self.index.remove(removed)
            self.save_index()
        return removed

    def search(self, text: str, k: int = 5, ids=None) -> list[SearchHit]:
        """The ``k`` stored chunks most similar to ``text``, best first; only among the chunk
        ids ``ids`` when given (see :meth:`ChunkIndex.search`)."""
        return self.search_vector(self.embedder.embed([text])[0], k, ids)

    def search_vector(self, query, k: int = 5, ids=None) -> list[SearchHit]:
        """:meth:`search` for an embedded query (``embedder.embed([text])[0]``)."""
        if self.shared and self.kv.generation() != self._generation:
            self.sync_index()  # another process added or deleted chunks
        hits = []
        for cid, score in self.index.search(query, k, ids):
            meta = self.kv.meta_for_id(cid)
            if meta is not None:  # evicted by another process since: skip
                hits.append(SearchHit(cid, score, meta))
        return hits

    def indexable_ids(self) -> set[int]:
        """Ids of the stored chunks that belong to a document (the ones the index holds)."""
        return {m.chunk_id for m in self.kv.iter_meta() if m.doc_id is not None}

    def sync_index(self) -> tuple[int, int]:
        """Make the index hold exactly the stored document chunks; returns (removed, added)."""
        if self.shared:
            self._generation = self.kv.generation()
        metas = {m.chunk_id: m for m in self.kv.iter_meta() if m.doc_id is not None}
        store_ids = set(metas)
        index_ids = set(self.index.ids().tolist())
        stale = sorted(index_ids - store_ids)
        missing = sorted(store_ids - index_ids)
        if stale:
            self.index.remove(stale)
        if missing:
            self.index.add(missing, self._vectors([metas[cid] for cid in missing]))
        if stale or missing:
            self.save_index()
        return len(stale), len(missing)

    def _vectors(self, metas: list[ChunkMeta]) -> np.ndarray:
        """Embeddings of stored chunks: from a shared store where kept, else embedded now."""
        stored = self.kv.embeddings([m.key for m in metas]) if self.shared else [None] * len(metas)
        todo = [i for i, raw in enumerate(stored) if raw is None]
        out = np.empty((len(metas), self.embedder.dim), dtype=np.float32)
        for i, raw in enumerate(stored):
            if raw is not None:
                out[i] = np.frombuffer(raw, dtype=np.float32)
        if todo:
            fresh = self.embedder.embed([metas[i].text for i in todo])
            out[todo] = fresh
            if self.shared and not self.kv.readonly:
                self.kv.put_embeddings([metas[i].key for i in todo], fresh)
        return out

    def verify(self) -> VerifyReport:
        """Store verify plus index <-> store id agreement."""
        report = self.kv.verify()
        doc_of = {m.chunk_id: m.doc_id for m in self.kv.iter_meta() if m.doc_id is not None}
        index_ids = self.index.ids().tolist()
        if len(index_ids) != len(set(index_ids)):
            report.add("index_duplicate", "index", "an id appears more than once")
        for cid in sorted(set(index_ids) - doc_of.keys()):
            report.add("index_orphan", cid, "indexed but not in the store")
        for cid in sorted(doc_of.keys() - set(index_ids)):
            report.add(
                "index_missing",
                cid,
                f"stored (document {doc_of[cid]!r}) but not indexed; a writable open re-indexes it",
            )
        return report
