"""Metadata and health queries of a :class:`~blendkv.store.redis_store.RedisKVStore`: chunk
metadata by key, id and document; stats and verify (on a Redis Cluster: ``INFO`` summed over
the masters, markers scanned master by master).

A mixin over the store's client, key helpers and counters; kept apart from the value paths.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from . import format as fmt
from .errors import CorruptValueError
from .records import ChunkMeta, StoreStats, VerifyReport


class RedisQueries:
    # ---- metadata -----------------------------------------------------------------------
    def get_meta(self, key: bytes) -> ChunkMeta | None:
        raw = self._call(lambda: self.client.get(self._chunk(key, "m")), None)
        return ChunkMeta.from_json(raw) if raw is not None else None

    def meta_for_id(self, chunk_id: int) -> ChunkMeta | None:
        hexkey = self._call(lambda: self.client.get(self._k("id", chunk_id)), None)
        return self.get_meta(bytes.fromhex(hexkey.decode())) if hexkey else None

    def _metas(self, hexkeys) -> list[ChunkMeta]:
        keys = [bytes.fromhex(h.decode()) for h in hexkeys]
        raws = self._call(lambda: self._mget([self._chunk(k, "m") for k in keys]), None)
        return [ChunkMeta.from_json(r) for r in raws or [] if r is not None]

    def iter_meta(self) -> Iterator[ChunkMeta]:
        yield from self._metas(self._call(lambda: self.client.smembers(self._k("chunks")), set()))

    def chunk_ids(self) -> list[int]:
        return sorted(m.chunk_id for m in self.iter_meta())

    def document_chunks(self, doc_id: str) -> list[ChunkMeta]:
        members = self._call(lambda: self.client.smembers(self._k("doc", doc_id)), set())
        return sorted(self._metas(members), key=lambda m: m.position)

    # ---- health -------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        metas = list(self.iter_meta())
        return StoreStats(
            entries=len(metas),
            bytes=sum(m.nbytes for m in metas),
            max_bytes=None,
            map_size=0,
            map_used=int(self._call(lambda: self._info_sum("memory", "used_memory"), 0)),
            evictions=int(self._call(lambda: self._info_sum("stats", "evicted_keys"), 0)),
            hits=self.hits,
            misses=self.misses,
            corrupt=self.corrupt,
            **self.memory_tier.stats_fields(),
            lmdb_hits=0,
            lmdb_misses=0,
        )

    def _info_sum(self, section: str, field: str) -> int:
        """An ``INFO`` field, summed over a cluster's masters."""
        if not self.cluster:
            return int(self.client.info(section)[field])
        found = self.client.info(section, target_nodes=self.client.PRIMARIES)
        if field in found:  # one master: redis-py answers that node's dict
            return int(found[field])
        return sum(int(node[field]) for node in found.values())

    def _markers(self, report: VerifyReport) -> set[bytes]:
        """The keys of every stored chunk marker; on a cluster, each master scanned alone (one
        that is down is reported unreachable, its chunks then count as missing)."""
        match = f"{self.namespace}:c:*:m"
        if not self.cluster:
            names = list(self.client.scan_iter(match=match, count=1000))
        else:
            names = []
            for node in self.client.get_primaries():
                try:
                    names += node.redis_connection.scan_iter(match=match, count=1000)
                except self._redis_errors as e:
                    report.add("unreachable", node.name, str(e))
        return {bytes.fromhex(k.decode().rsplit("{", 1)[1].split("}")[0]) for k in names}

    def verify(self) -> VerifyReport:
        """Every chunk's value checked; sets, ids and markers agreeing; the server reachable."""
        report = VerifyReport()
        with self._lock:
            try:
                self._verify(report)
            except self._redis_errors as e:
                report.add("unreachable", self.url, str(e))
        return report

    def _verify(self, report: VerifyReport) -> None:
        c = self.client
        members = {bytes.fromhex(h.decode()) for h in c.smembers(self._k("chunks"))}
        markers = self._markers(report)
        for key in sorted(markers - members):
            report.add("unindexed", key.hex(), "chunk stored but not in the chunk set")
        for key in sorted(members - markers):
            report.add(
                "missing_value", key.hex(), "in the chunk set but not stored (evicted, or on a "
                "cluster node that is down?)",
            )  # fmt: skip
        for key in sorted(markers & members):
            raw = c.get(self._chunk(key, "m"))
            if raw is None:
                continue  # evicted meanwhile
            record = json.loads(raw)
            parts = self._mget([self._chunk(key, f"p:{i}") for i in range(record["parts"])])
            if any(p is None for p in parts):
                report.add("missing_value", key.hex(), "a part was evicted")
                continue
            try:
                fmt.check_value(b"".join(parts), verify_checksum=True, codec=self.kv_codec)
            except CorruptValueError as e:
                report.add("corrupt_value", key.hex(), str(e))
                continue
            if c.get(self._k("id", record["chunk_id"])) != key.hex().encode():
                report.add("id_mismatch", record["chunk_id"], "id map disagrees")
            report.entries += 1
            report.bytes += record["nbytes"]
