"""Chunk K/V in Redis: one set of document K/V shared by many engine processes.

The same interface as the LMDB :class:`~blendkv.store.KVStore` (``get``, ``read_into``,
``put_many``, ``in``, ``delete``, ``meta_for_id``, ``stats``, ``verify``, ``fingerprint``) and
the same value bytes: a 64-byte header, the raw tensor bytes, an xxh3 checksum (never pickle).
Keys live under one namespace ``ns`` (``blendkv`` by default)::

    {ns}:format, {ns}:fp           store kind/version, the model fingerprint (JSON)
    ns:c:{<key hex>}:m             chunk metadata (JSON, with "parts"): written LAST
    ns:c:{<key hex>}:p:<i>         the value, split into parts of at most ``part_bytes``
    ns:c:{<key hex>}:e             the chunk's text embedding (float32), for FAISS rebuilds
    {ns}:next_id, {ns}:id:<id>     chunk id counter, chunk id -> key hex
    {ns}:chunks, {ns}:doc:<doc>    sets of key hex: every chunk, a document's chunks
    {ns}:gen                       bumped on every add/delete (other processes re-sync FAISS)
    {ns}:catalog                   the RAG document catalog (blendkv.rag.catalog)

Two hash tags, so a Redis Cluster (:mod:`.redis_wire` follows its redirects) serves every
multi-key operation from one slot: a chunk's parts and metadata share ``{<key hex>}`` and are
written in ONE ``MULTI`` (a reader sees a whole chunk or none); the store-wide records share
``{ns}`` (one slot: the fingerprint's ``MULTI``). The id/document sets are updated right after
a chunk (a crash between the two leaves a chunk that ``verify`` reports as unindexed). Stores
written before the ``{ns}`` tag (keys ``ns:fp`` ...) are renamed to it when first opened
writable on a single server. On a cluster whose masters have replicas every write waits for
one replica (``WAIT``), so a promoted replica holds every chunk a put returned; while a
master is down its slots are misses (and failed writes), never errors reaching a request.
Eviction is Redis' own ``maxmemory`` policy: a chunk whose
parts were evicted is a miss (its remains are deleted), never an error. A lost connection makes
reads misses and writes fail (the engine recomputes and says so in ``connection_errors``);
redis-py reconnects on the next call, and the fingerprint is re-checked (re-created on a
server that lost everything).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from . import codecs, layout
from . import format as fmt
from .base import fill_misses
from .codecs import EncodedKV, decode_reference
from .errors import (
    CorruptValueError,
    FingerprintMismatchError,
    StoreError,
    StoreFormatError,
    StoreReadOnlyError,
)
from .fingerprint import ModelFingerprint, mismatch_message
from .memory_tier import MemoryTier
from .records import ChunkKV, ChunkMeta, NewChunk, PutResult, StoreStats, VerifyReport
from .redis_wire import bulk_reader_for

logger = logging.getLogger(__name__)


def is_redis_url(location: object) -> bool:
    return isinstance(location, str) and location.startswith(("redis://", "rediss://", "unix://"))


class RedisKVStore:
    """See the module docstring. ``fingerprint=None`` opens in inspect mode (stats, verify)."""

    tier = "redis"
    pin_memory = False
    reads_in_place = False  # values are read whole over the network (get, read_into)

    def __init__(
        self,
        url: str,
        fingerprint: ModelFingerprint | None = None,
        *,
        create: bool = True,
        readonly: bool = False,
        namespace: str = "blendkv",
        memory_tier_bytes: int = 256 << 20,
        part_bytes: int = 8 << 20,
        socket_timeout: float = 5.0,
        max_bytes: int | None = None,
    ) -> None:
        import redis

        if max_bytes is not None:
            raise ValueError(
                "a Redis store's size is bounded by the server's maxmemory (and its eviction "
                "policy, e.g. allkeys-lru), not max_bytes"
            )
        self._redis_errors = _lost_connection_errors()
        self.wait_timeout_ms = int(socket_timeout * 1000)
        self._replicated: dict[str, tuple[bool, float]] = {}  # node -> (has a replica, when)
        self.url = url
        self.path = url  # what messages and the CLI print
        self.namespace = namespace
        self.readonly = readonly
        self.part_bytes = part_bytes
        self.memory_tier = MemoryTier(memory_tier_bytes)
        self.hits = self.misses = self.corrupt = self.connection_errors = 0
        self._lock = threading.RLock()
        self._recheck = False
        try:
            self.client = _client_for(url, socket_timeout)
        except self._redis_errors as e:
            raise StoreError(f"cannot reach the Redis store at {url}: {e}") from e
        self.cluster = not isinstance(self.client, redis.Redis)
        # Values are read into one buffer per chunk over connections of its own (per thread).
        self._bulk = bulk_reader_for(self.client, socket_timeout)
        try:
            self.fingerprint = self._open(fingerprint, create)
        except self._redis_errors as e:
            raise StoreError(f"cannot reach the Redis store at {url}: {e}") from e
        self.inspect_only = fingerprint is None
        self._given = fingerprint

    # ---- keys ---------------------------------------------------------------------------
    def _k(self, *parts: object) -> str:
        """A store-wide key: all of them share the ``{ns}`` hash tag (one cluster slot)."""
        return ":".join((f"{{{self.namespace}}}", *map(str, parts)))

    def _mget(self, names: list[str]) -> list[bytes | None]:
        """``MGET`` of keys that may lie in many slots (one ``MGET`` per node on a cluster)."""
        if not names:
            return []
        return self.client.mget_nonatomic(names) if self.cluster else self.client.mget(names)

    def _wait_replica(self, name: str) -> None:
        """On a cluster, wait until one replica of ``name``'s master has every write so far
        (``WAIT 1``); a master without a connected replica (``INFO replication``, re-asked
        every few seconds) is not waited on."""
        if not self.cluster:
            return
        node = self.client.get_node_from_key(name)
        now = time.monotonic()
        known = self._replicated.get(node.name)
        if known is None or now - known[1] > 5.0:
            info = self.client.info("replication", target_nodes=node)
            info = info.get(node.name, info)  # redis-py may key the answer by node
            known = self._replicated[node.name] = (int(info.get("connected_slaves", 0)) > 0, now)
        if not known[0]:
            return
        acked = self.client.execute_command("WAIT", 1, self.wait_timeout_ms, target_nodes=node)
        if int(acked) < 1:
            logger.warning("Redis store %s: no replica acknowledged a write to %s", self.url, name)

    def _chunk(self, key: bytes, suffix: str) -> str:
        return f"{self.namespace}:c:{{{key.hex()}}}:{suffix}"

    # ---- opening ------------------------------------------------------------------------
    def _open(self, given: ModelFingerprint | None, create: bool) -> ModelFingerprint:
        record = {"kind": layout.STORE_KIND, "version": layout.STORE_FORMAT_VERSION}
        raw_fp = self.client.get(self._k("fp"))
        if raw_fp is None and self.client.get(f"{self.namespace}:fp") is not None:
            raw_fp = self._migrate_legacy_keys()
        if raw_fp is None:
            if given is None or not create or self.readonly:
                raise StoreFormatError(
                    f"no blendkv store at {self.url} (namespace {self.namespace})"
                )
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self._k("format"), json.dumps(record), nx=True)
            pipe.set(self._k("fp"), given.to_json(), nx=True)
            pipe.execute()
            raw_fp = self.client.get(self._k("fp"))  # another process may have won the race
        raw_format = self.client.get(self._k("format"))
        try:
            stored = ModelFingerprint.from_json(raw_fp)
            found = json.loads(raw_format) if raw_format is not None else None
        except (ValueError, TypeError) as e:
            raise StoreFormatError(f"{self.url}: unreadable fingerprint record: {e}") from e
        if found != record:
            raise StoreFormatError(f"{self.url} holds store format {found}, expected {record}")
        if given is not None and given != stored:
            raise FingerprintMismatchError(
                mismatch_message(self.url, given, stored), given.diff(stored)
            )
        return stored

    def _migrate_legacy_keys(self) -> bytes | None:
        """Rename a store written before the ``{ns}`` hash tag (``ns:fp``, ``ns:chunks`` ...)
        to it, in one ``MULTI``; its chunk keys are unchanged. Only on a single server."""
        import redis

        ns = self.namespace
        if self.readonly or self.cluster:
            raise StoreFormatError(
                f"{self.url} holds a blendkv store in the key layout before Redis Cluster "
                f"support ({ns}:fp, {ns}:chunks ...; now {{{ns}}}:fp ...): open it once "
                "writable on a single server to rename its keys"
            )
        old = [f"{ns}:{k}" for k in ("format", "fp", "next_id", "gen", "chunks", "catalog")]
        old += [k.decode() for p in ("id", "doc") for k in self.client.scan_iter(f"{ns}:{p}:*")]
        pipe = self.client.pipeline(transaction=True)
        for name in old:
            if self.client.exists(name):
                pipe.rename(name, self._k(name[len(ns) + 1 :]))
        try:
            pipe.execute()
            logger.info(
                "Redis store %s: renamed %d keys to the {%s} hash tag", self.url, len(old), ns
            )
        except redis.ResponseError:  # another process renamed them first
            pass
        return self.client.get(self._k("fp"))

    def _call(self, fn, on_error, *, locked: bool = True):
        """Run ``fn()`` under the lock (``locked``; a value read runs beside other threads'
        calls); a lost connection counts, logs and returns ``on_error`` (or raises StoreError
        when ``on_error`` is an exception class)."""
        try:
            if self._recheck:
                with self._lock:
                    if self._recheck:
                        self._open(self._given, create=not self.readonly)
                        self._recheck = False
            if not locked:
                return fn()
            with self._lock:
                return fn()
        except self._redis_errors as e:
            with self._lock:
                self.connection_errors += 1
                self._recheck = True
            logger.warning("Redis store %s unreachable: %s", self.url, e)
            if isinstance(on_error, type) and issubclass(on_error, Exception):
                raise on_error(f"Redis store {self.url} unreachable: {e}") from e
            return on_error

    def close(self) -> None:
        if self._bulk is not None:
            self._bulk.close()
        self.client.close()

    def flush(self) -> None:
        """Nothing is batched on this side (LRU bookkeeping is Redis' own)."""

    def __enter__(self) -> RedisKVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_servable(self) -> None:
        if self.inspect_only:
            raise StoreError(f"store {self.url} was opened without a fingerprint (inspect mode)")

    # ---- reading ------------------------------------------------------------------------
    def _fetch(self, key: bytes) -> bytearray | None:
        """The whole stored value, checked; None on a miss (also: parts evicted, corrupt)."""
        raw = self.client.get(self._chunk(key, "m"))
        if raw is None:
            return None
        record = json.loads(raw)
        names = [self._chunk(key, f"p:{i}") for i in range(record["parts"])]
        if self._bulk is not None and "nbytes" in record:
            value = self._bulk.read(names, record["nbytes"])
        else:
            value = _joined(self.client.mget(names))
        if value is None:  # evicted under maxmemory (or cut short): a miss
            self._delete_one(key)
            return None
        try:
            fmt.check_value(value, verify_checksum=True, codec=self.kv_codec)
        except CorruptValueError as e:
            with self._lock:
                self.corrupt += 1
            logger.warning("corrupt value for chunk %s in %s: %s", key.hex(), self.url, e)
            if not self.readonly:
                self._delete_one(key)
            return None
        return value

    @property
    def kv_codec(self) -> str:
        """How this store encodes K/V (:mod:`blendkv.store.codecs`); from its fingerprint."""
        return self.fingerprint.kv_codec

    def _load(self, key: bytes, skip_memory_tier: bool = False) -> torch.Tensor | EncodedKV | None:
        use_tier = self.memory_tier.max_bytes and not skip_memory_tier
        tensor = self.memory_tier.get(key) if use_tier else None
        if tensor is None:
            value = self._call(lambda: self._fetch(key), None, locked=False)
            if value is None:
                with self._lock:
                    self.misses += 1
                return None
            header = fmt.decode_header(value)
            payload = torch.frombuffer(value, dtype=torch.uint8, offset=fmt.HEADER_SIZE)
            if self.pin_memory:
                payload = payload.pin_memory()
            tensor = fmt.decode_payload(payload, header)
            self.memory_tier.put(key, tensor)
        with self._lock:
            self.hits += 1
        return tensor

    def get(self, key: bytes, *, skip_memory_tier: bool = False) -> ChunkKV | None:
        self._check_servable()
        tensor = self._load(key, skip_memory_tier)
        return None if tensor is None else ChunkKV(key, decode_reference(tensor))

    def get_encoded(
        self, key: bytes, *, skip_memory_tier: bool = False
    ) -> torch.Tensor | EncodedKV | None:
        """:meth:`KVStore.get_encoded <blendkv.store.KVStore.get_encoded>`: the value as
        stored (a tensor for codec ``none``, else an :class:`EncodedKV`), not decoded."""
        self._check_servable()
        return self._load(key, skip_memory_tier)

    def read_into(self, key: bytes, out: torch.Tensor, *, admit: bool = True) -> bool:
        self._check_servable()
        tensor = self._load(key)
        if tensor is None:
            return False
        if tuple(tensor.shape) != tuple(out.shape) or tensor.dtype != out.dtype:
            raise ValueError(
                f"out is {out.dtype}{tuple(out.shape)}, stored {tensor.dtype}{tuple(tensor.shape)}"
            )
        out.copy_(decode_reference(tensor))
        return True

    def warm(self, key: bytes) -> bool:
        """False: nothing to warm; a value is read whole by :meth:`get` (a prefetch holds it)."""
        return False

    def snapshot(self) -> None:
        """None: Redis values cannot be viewed in place; read them with :meth:`get`."""
        return None

    def __contains__(self, key: bytes) -> bool:
        if key in self.memory_tier:  # served locally even while Redis is unreachable
            return True
        return bool(self._call(lambda: self.client.exists(self._chunk(key, "m")), False))

    def contains_many(self, keys) -> list[bool]:
        return fill_misses([key in self.memory_tier for key in keys], keys, self._exist)

    def _exist(self, keys: list[bytes]) -> list[bool]:
        """Whether each chunk is stored on the server: one pipeline of EXISTS (all False when
        the server cannot be reached)."""

        def exists() -> list:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._chunk(key, "m"))
            return pipe.execute()

        return [bool(n) for n in self._call(exists, [0] * len(keys))]

    def __len__(self) -> int:
        return int(self._call(lambda: self.client.scard(self._k("chunks")), 0))

    def generation(self) -> int:
        """Bumped by every add and delete from any process."""
        return int(self._call(lambda: self.client.get(self._k("gen")) or 0, 0))

    # ---- writing ------------------------------------------------------------------------
    def put(self, key: bytes, kv: torch.Tensor, **meta) -> PutResult:
        return self.put_many([NewChunk(key, kv, **meta)])[0]

    def put_many(self, chunks: Sequence[NewChunk]) -> list[PutResult]:
        """Store chunks; each chunk is one MULTI (parts, then its metadata marker)."""
        self._check_servable()
        if self.readonly:
            raise StoreError(f"store {self.url} is open read-only")
        return self._call(lambda: [self._put_one(c) for c in chunks], StoreError)

    def _put_one(self, chunk: NewChunk) -> PutResult:
        fp, kv = self.fingerprint, chunk.kv
        want = (fp.num_layers, 2, fp.num_kv_heads, fp.head_dim)
        if len(kv.shape) != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            raise ValueError(f"chunk K/V shape {tuple(kv.shape)} does not match the store")
        import redis

        marker = self._chunk(chunk.key, "m")
        value = None
        while True:  # again only when the chunk was stored and deleted meanwhile
            raw = self.client.get(marker)
            if raw is not None:
                return PutResult(json.loads(raw)["chunk_id"], False, ())
            if value is None:
                value = fmt.encode_value(codecs.encode_for_store(self.kv_codec, kv, self.url))
            with self.client.pipeline(transaction=True) as pipe:
                # Processes that computed the same chunk (ingest workers, engines writing
                # back) race here: WATCH makes the first EXEC win and the others find its
                # chunk, so a chunk written twice is stored once (one chunk id, one value).
                pipe.watch(marker)
                if pipe.get(marker) is not None:
                    continue
                cid = int(self.client.incr(self._k("next_id")))
                meta = ChunkMeta.for_new(chunk, cid, len(value), time.time())
                record = json.loads(meta.to_json())
                size = self.part_bytes
                parts = [value[i : i + size] for i in range(0, len(value), size)]
                record["parts"] = len(parts)
                pipe.multi()  # MULTI ... EXEC
                for i, part in enumerate(parts):
                    pipe.set(self._chunk(chunk.key, f"p:{i}"), bytes(part))
                pipe.set(marker, json.dumps(record))  # the marker, last
                try:
                    pipe.execute()
                    break
                except redis.WatchError:  # another process stored it first: theirs stands
                    continue
        self._wait_replica(marker)
        index = self.client.pipeline(transaction=False)
        index.set(self._k("id", cid), chunk.key.hex())
        index.sadd(self._k("chunks"), chunk.key.hex())
        if chunk.doc_id is not None:
            index.sadd(self._k("doc", chunk.doc_id), chunk.key.hex())
        index.incr(self._k("gen"))
        index.execute()
        self._wait_replica(self._k("gen"))
        return PutResult(cid, True, ())

    def put_embeddings(self, keys: Sequence[bytes], vectors) -> None:
        """Keep chunks' text embeddings (float32 rows) for FAISS rebuilds in other processes."""

        def write():
            pipe = self.client.pipeline(transaction=False)
            for key, vec in zip(keys, vectors, strict=True):
                pipe.set(self._chunk(key, "e"), vec.astype("float32").tobytes())
            pipe.execute()

        self._call(write, StoreError)

    def embeddings(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._call(
            lambda: self._mget([self._chunk(k, "e") for k in keys]),
            StoreError,
        )

    def delete(self, keys: Sequence[bytes]) -> list[int]:
        for key in keys:
            self.memory_tier.discard(key)
        found = self._call(lambda: [self._delete_one(k) for k in keys], StoreError)
        return [cid for cid in found if cid is not None]

    def _delete_one(self, key: bytes) -> int | None:
        raw = self.client.get(self._chunk(key, "m"))
        record = json.loads(raw) if raw is not None else None
        parts = record["parts"] if record else 0
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self._chunk(key, "m"), self._chunk(key, "e"))
        for i in range(parts):
            pipe.delete(self._chunk(key, f"p:{i}"))
        pipe.execute()
        index = self.client.pipeline(transaction=False)
        index.srem(self._k("chunks"), key.hex())
        if record is not None:
            index.delete(self._k("id", record["chunk_id"]))
            if record["doc_id"] is not None:
                index.srem(self._k("doc", record["doc_id"]), key.hex())
        index.incr(self._k("gen"))
        index.execute()
        return record["chunk_id"] if record else None

    def delete_document(self, doc_id: str) -> list[int]:
        return self.delete([m.key for m in self.document_chunks(doc_id)])

    def reassign(self, moves: Sequence[tuple[bytes, str, int]]) -> int:
        """:meth:`KVStore.reassign <blendkv.store.KVStore.reassign>`: each chunk's metadata is
        rewritten, then the document sets follow (as a put)."""
        return sum(self._call(lambda: [self._reassign_one(*m) for m in moves], StoreError))

    def _reassign_one(self, key: bytes, doc_id: str, position: int) -> bool:
        raw = self.client.get(self._chunk(key, "m"))
        if raw is None:
            return False
        record = json.loads(raw)
        old = record["doc_id"]
        record.update(doc_id=doc_id, position=position)
        self.client.set(self._chunk(key, "m"), json.dumps(record))
        index = self.client.pipeline(transaction=False)
        if old is not None:
            index.srem(self._k("doc", old), key.hex())
        index.sadd(self._k("doc", doc_id), key.hex())
        index.incr(self._k("gen"))
        index.execute()
        return True

    # ---- metadata -----------------------------------------------------------------------
    def get_setting(self, name: str) -> bytes | None:
        """A store-wide value every engine sharing the store reads (e.g. its calibration)."""
        return self._call(lambda: self.client.get(self._k("setting", name)), StoreError)

    def put_setting(self, name: str, value: bytes) -> None:
        if self.readonly:
            raise StoreReadOnlyError(f"store {self.url} is open read-only")
        self._call(lambda: self.client.set(self._k("setting", name), value), StoreError)

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
                "missing_value",
                key.hex(),
                "in the chunk set but not stored (evicted, or on a cluster node that is down?)",
            )
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


def _lost_connection_errors() -> tuple[type[Exception], ...]:
    """The redis-py errors that mean the server is out of reach. A cluster slot whose master is
    down (CLUSTERDOWN, TRYAGAIN, not covered) is a lost connection too: reads miss, writes
    fail, until a replica is promoted."""
    import redis
    from redis.exceptions import ClusterError, RedisClusterException

    return (redis.ConnectionError, redis.TimeoutError, ClusterError, RedisClusterException)


def _client_for(url: str, socket_timeout: float):
    """A ``redis.Redis`` for a single server, or a ``redis.cluster.RedisCluster`` (redirects,
    a pool per node) when the server at ``url`` says ``cluster_enabled:1`` (``INFO cluster``):
    any node's URL reaches the whole cluster."""
    import redis
    from redis.cluster import RedisCluster

    kw = dict(socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
    client = redis.Redis.from_url(url, **kw)
    if not url.startswith(("redis://", "rediss://")):  # a unix socket: never a cluster
        return client
    try:
        enabled = int(client.info("cluster").get("cluster_enabled", 0))
    except redis.ResponseError:  # INFO refused (ACL) or unknown section: a single server
        enabled = 0
    if not enabled:
        return client
    client.close()
    return RedisCluster.from_url(url, require_full_coverage=False, **kw)


def _joined(parts: list[bytes | None]) -> bytearray | None:
    """Parts read through redis-py joined into one writable buffer; None if one is missing."""
    if any(p is None for p in parts):
        return None
    value = bytearray(sum(len(p) for p in parts))
    pos = 0
    for part in parts:
        value[pos : pos + len(part)] = part
        pos += len(part)
    return value
