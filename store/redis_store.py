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

import torch

from . import format as fmt
from . import layout
from .base import fill_misses
from .codecs import EncodedKV, decode_reference
from .errors import CorruptValueError, FingerprintMismatchError, StoreError, StoreFormatError
from .fingerprint import ModelFingerprint, mismatch_message
from .memory_tier import MemoryTier
from .records import ChunkKV
from .redis_queries import RedisQueries
from .redis_wire import bulk_reader_for
from .redis_writes import RedisWrites

logger = logging.getLogger(__name__)


def is_redis_url(location: object) -> bool:
    return isinstance(location, str) and location.startswith(("redis://", "rediss://", "unix://"))


class RedisKVStore(RedisWrites, RedisQueries):
    """See the module docstring. ``fingerprint=None`` opens in inspect mode (stats, verify)."""

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
        from redis.exceptions import ClusterError, RedisClusterException

        # A cluster slot whose master is down (CLUSTERDOWN, TRYAGAIN, not covered) is a lost
        # connection too: reads miss, writes fail, until a replica is promoted.
        self._redis_errors = (
            redis.ConnectionError, redis.TimeoutError, ClusterError, RedisClusterException,
        )  # fmt: skip
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

    tier = "redis"
    pin_memory = False
    reads_in_place = False  # values are read whole over the network (get, read_into)

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
