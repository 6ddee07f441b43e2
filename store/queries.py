"""Read-only queries of a :class:`~blendkv.store.kv_store.KVStore`: metadata and health.

A mixin over the store's read transactions (``self._read()``) and named databases
(``self._dbs``); kept apart from the write/read paths of the values themselves.
"""

from __future__ import annotations

from collections.abc import Iterator

from . import layout, txn_ops
from .records import ChunkMeta, StoreStats, VerifyReport
from .verify import verify_txn


class StoreQueries:
    def __contains__(self, key: bytes) -> bool:
        with self._read() as txn:
            return txn.get(key, db=self._dbs["chunks"]) is not None

    def contains_many(self, keys) -> list[bool]:
        db = self._dbs["chunks"]
        with self._read() as txn:
            return [txn.get(key, db=db) is not None for key in keys]

    def __len__(self) -> int:
        with self._read() as txn:
            return txn.stat(self._dbs["chunks"])["entries"]

    # ---- metadata --------------------------------------------------------------------------

    def _meta(self, txn, key: bytes) -> ChunkMeta | None:
        raw = txn.get(key, db=self._dbs["chunks"])
        if raw is None:
            return None
        usage = txn.get(key, db=self._dbs["usage"])
        return ChunkMeta.from_json(raw, layout.unpack_usage(usage)[1] if usage else 0.0)

    def get_meta(self, key: bytes) -> ChunkMeta | None:
        with self._read() as txn:
            return self._meta(txn, key)

    def key_for_id(self, chunk_id: int) -> bytes | None:
        with self._read() as txn:
            key = txn.get(layout.be64(chunk_id), db=self._dbs["ids"])
            return bytes(key) if key is not None else None

    def meta_for_id(self, chunk_id: int) -> ChunkMeta | None:
        with self._read() as txn:
            key = txn.get(layout.be64(chunk_id), db=self._dbs["ids"])
            return self._meta(txn, bytes(key)) if key is not None else None

    def chunk_ids(self) -> list[int]:
        with self._read() as txn:
            return [layout.from_be64(k) for k, _ in txn.cursor(db=self._dbs["ids"])]

    def iter_meta(self) -> Iterator[ChunkMeta]:
        with self._read() as txn:
            for key, _ in txn.cursor(db=self._dbs["chunks"]):
                yield self._meta(txn, bytes(key))

    def document_chunks(self, doc_id: str) -> list[ChunkMeta]:
        """Metadata of every chunk of ``doc_id``, ordered by position."""
        prefix = layout.doc_prefix(doc_id)
        metas = []
        with self._read() as txn:
            cursor = txn.cursor(db=self._dbs["docs"])
            if cursor.set_range(prefix):
                for entry, key in cursor:
                    if not bytes(entry).startswith(prefix):
                        break
                    metas.append(self._meta(txn, bytes(key)))
        return sorted((m for m in metas if m is not None), key=lambda m: m.position)

    def evictable_bytes(self) -> int:
        """Bytes of the chunks no document owns: what the LRU may evict past ``max_bytes``."""
        total = 0
        with self._read() as txn:
            for _, raw in txn.cursor(db=self._dbs["chunks"]):
                if txn_ops.evictable(raw):
                    total += ChunkMeta.from_json(raw).nbytes
        return total

    def lru_keys(self) -> list[bytes]:
        """Keys from least to most recently used (flushes pending touches first)."""
        self.flush()
        with self._read() as txn:
            return [bytes(k) for _, k in txn.cursor(db=self._dbs["lru"])]

    # ---- health ----------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._read() as txn:
            counters = layout.Counters.read(txn, self._dbs["store"])
            entries = txn.stat(self._dbs["chunks"])["entries"]
        info, stat = self._env.info(), self._env.stat()
        return StoreStats(
            entries=entries,
            bytes=counters.total_bytes,
            max_bytes=self.max_bytes,
            map_size=info["map_size"],
            map_used=(info["last_pgno"] + 1) * stat["psize"],
            evictions=counters.evictions,
            hits=self.hits,
            misses=self.misses,
            corrupt=self.corrupt,
            **self.memory_tier.stats_fields(),
            lmdb_hits=self.lmdb_hits,
            lmdb_misses=self.lmdb_misses,
        )

    def verify(self) -> VerifyReport:
        """Re-check every value's header and checksum and the cross-database consistency."""
        report = VerifyReport()
        with self._read() as txn:
            verify_txn(txn, self._dbs, report, self.kv_codec)
        return report
