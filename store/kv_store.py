"""Persistent chunk-K/V store over LMDB, with a memory tier in front.

One LMDB environment per store (its databases: :mod:`.layout`); many processes read while one
writes, and every chunk write is one transaction whose operations keep all databases and the
store-wide counters in step, so no reader ever sees half an entry. Reads copy at most once
(through LMDB's memory map, :meth:`KVStore.read_into` / :meth:`KVStore.get`);
:meth:`KVStore.reader` and :meth:`KVStore.snapshot` give zero-copy views (:mod:`.reader`) for a
read transaction or an engine step. LMDB may not remap while a transaction of this process is
open; a snapshot stays open across threads for a whole engine step, so a write that must grow
the map waits for the open snapshots (:meth:`KVStore._wait_for_snapshots`). One process may not
open a store twice (LMDB's locks are per process); a ``KVStore`` may be shared between threads,
serialised by one re-entrant lock.

A bounded store (``max_bytes``) bounds its file on disk. LMDB never shrinks ``data.mdb`` and
never writes past its map, so the map is the bound and never grows; LMDB reuses a freed page
two commits later and only once no read snapshot predates that, and a value of several pages
needs them contiguous, so the file holds somewhat less K/V than the bound:

- before a write, least-recently-used chunks (none a document owns) are evicted in a
  transaction of their own until the pages in use (LMDB's page counts) plus the write's leave
  a reserve of free pages (room for the next eviction to copy its B-tree pages, and for runs
  of pages to be found); one more commit makes the freed pages reusable by the write;
- a write that still finds the map full (``MDB_MAP_FULL``: the free pages too scattered, or
  seen by a snapshot) evicts more the same way, waits for the snapshots open until then, and
  retries; when nothing is left to evict it raises :class:`StoreFullError`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import lmdb
import torch

from blendkv.sizes import format_size

from . import codecs, layout, opening
from . import format as fmt
from .capacity import MIN_FREE_PAGES, file_limit, reserve_pages, store_full_error, value_pages
from .codecs import EncodedKV, decode_reference
from .errors import CorruptValueError, StoreError, StoreFullError, StoreReadOnlyError
from .fingerprint import ModelFingerprint
from .locking import locked
from .memory_tier import MemoryTier
from .reader import ReadSnapshot, ZeroCopyReader
from .records import ChunkKV, ChunkMeta, NewChunk, PutResult, StoreStats, VerifyReport
from .verify import verify_txn

logger = logging.getLogger(__name__)


class KVStore:
    """Chunk K/V values plus metadata, content-addressed, LRU-bounded, fingerprint-checked.

    Args:
        path: store directory (created when missing and ``create`` is true).
        fingerprint: the model's fingerprint. ``None`` opens an existing store in *inspect*
            mode: stats, metadata and verify work, K/V is neither served nor written.
        create: create the store if the directory is missing or empty.
        readonly: open without write access (implies ``create=False``).
        max_bytes: the bound of the store's file on disk (``data.mdb``; 1 MiB at least,
            :data:`~blendkv.store.capacity.MIN_FILE_BYTES`), saved in the store (``None``: the
            saved one, if any). The K/V values also stay within it. Past it, the
            least-recently-used chunks no document owns are evicted, then a write raises
            :class:`StoreFullError`. A file already larger (a store made before the bound, or
            the bound lowered) stops growing but does not shrink: ``blendkv store compact``
            rewrites it.
        map_size: initial LMDB map size in bytes of an unbounded store; it grows automatically
            when full (a bounded store's map is its bound).
        memory_tier_bytes: budget of the in-RAM LRU of hot chunks (0 disables it).
        verify_reads: payload checksum on reads from LMDB: ``True`` on every read, ``"once"``
            on the first read of each key by this object (values are immutable once written;
            the header is still checked every time), ``False`` never.
        sync: fsync on commit (off trades durability on power loss, not consistency, for speed).
        touch_flush_every: LRU touches from reads are batched and written every this many.

    Attributes:
        max_bytes: the capacity in value bytes in force: the one given, else the saved one
            (None: unbounded).
        memory_tier: the in-RAM LRU of hot chunks.
        fingerprint: the store's model fingerprint.
        inspect_only: opened without a fingerprint: K/V is neither served nor written.
        hits: reads in this process that found their chunk.
        misses: reads that did not (absent or corrupt).
        corrupt: values that failed their checks.
        lmdb_hits: reads served from LMDB rather than the memory tier.
        lmdb_misses: LMDB reads that missed.
        connection_errors: always 0 (a Redis store counts lost connections).
        tier: "lmdb".
        pin_memory: False (values are read in place, not into pinned memory).
        reads_in_place: True: values are viewed in LMDB's memory map (``snapshot``, ``warm``).
    """

    tier = "lmdb"
    pin_memory = False
    reads_in_place = True

    def __init__(
        self,
        path: str | os.PathLike,
        fingerprint: ModelFingerprint | None = None,
        *,
        create: bool = True,
        readonly: bool = False,
        max_bytes: int | None = None,
        map_size: int = 1 << 30,
        memory_tier_bytes: int = 256 << 20,
        verify_reads: bool | str = "once",
        sync: bool = True,
        touch_flush_every: int = 256,
    ) -> None:
        self._lock = threading.RLock()
        self.path = Path(path)
        self.readonly = readonly
        self.max_bytes = max_bytes
        self._fitted_map: int | None = None  # the map size last set for the bound
        self._room_evicted: list[tuple[bytes, int]] = []  # by _make_room, for put_many
        self._room_pages = 0  # pages _make_room frees next (the write's size, doubling)
        if verify_reads not in (True, False, "once"):
            raise ValueError(f"verify_reads must be True, False or 'once', got {verify_reads!r}")
        self.verify_reads = verify_reads
        self._verified: set[bytes] = set()
        self.touch_flush_every = touch_flush_every
        self.memory_tier = MemoryTier(memory_tier_bytes)
        self.hits = self.misses = self.corrupt = 0
        self.connection_errors = 0
        self.lmdb_hits = self.lmdb_misses = 0
        self._pending_touches: OrderedDict[bytes, float] = OrderedDict()
        self._snapshots: list[ReadSnapshot] = []  # open ones; the map may not grow meanwhile
        self._no_snapshots = threading.Condition(self._lock)
        self._deferred_deletes: set[bytes] = set()  # corrupt values seen through a snapshot
        self._env: lmdb.Environment | None = None
        self._reg_key = None
        self._open(fingerprint, create=create, map_size=map_size, sync=sync)
        self.inspect_only = fingerprint is None

    def _open(
        self, fingerprint: ModelFingerprint | None, *, create: bool, map_size: int, sync: bool
    ) -> None:
        """Open (or create) the LMDB environment, check its format and the fingerprint, then
        adopt the saved ``max_bytes`` (none given) or save the given one. On any error the
        store is closed again (this process may then open the directory anew)."""
        is_new = opening.check_directory(
            self.path, create=create, readonly=self.readonly, fingerprint=fingerprint
        )
        self._reg_key = opening.register(self.path)
        if self.max_bytes is not None and not self.readonly:
            map_size = file_limit(self.max_bytes)
        try:
            self._env = opening.open_env(
                self.path, readonly=self.readonly, map_size=map_size, sync=sync
            )
            self._psize = self._env.stat()["psize"]
            self._main_db = self._env.open_db(None)  # its pages count too (_pages_in_use)
            self._dbs = opening.open_dbs(self._env, self.path, create=is_new)
            if is_new:
                self._write(lambda txn, _: opening.initialise(txn, self._dbs, fingerprint))
            with self._read() as txn:
                self.fingerprint = opening.check_format_and_fingerprint(
                    txn, self._dbs, self.path, fingerprint
                )
                saved = opening.read_max_bytes(txn, self._dbs)
            max_bytes = self.max_bytes
            if max_bytes is None:
                self.max_bytes = saved
            elif max_bytes != saved and not self.readonly:
                self._write(lambda txn, _: opening.write_max_bytes(txn, self._dbs, max_bytes))
            self._fit_map()
        except BaseException:
            self.close()
            raise

    @property
    def max_bytes(self) -> int | None:
        """The bound of the store's file on disk (see the class docstring); None: unbounded.
        Setting it takes effect at the next write."""
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or value <= 0):
            raise ValueError(f"max_bytes must be positive or None, got {value}")
        self._max_bytes = value

    @property
    def page_size(self) -> int:
        """LMDB's page size of this store's file, in bytes."""
        return self._psize

    @property
    def _map_limit(self) -> int | None:
        """The map size of a bounded, writable store (None: the map grows)."""
        if self._max_bytes is None or self.readonly:
            return None
        return file_limit(self._max_bytes)

    def _fit_map(self) -> None:
        """Set the map to the bound (holding the lock). Not while a snapshot's views point into
        the map: then at a later write. A file already past the bound keeps its size, plus
        what it lacks of ``MIN_FREE_PAGES`` free pages (an eviction copies B-tree pages before
        it frees any)."""
        limit = self._map_limit
        if limit is None or limit == self._fitted_map or self._snapshots:
            return
        size = limit
        in_file = self._env.info()["last_pgno"] + 1
        if in_file * self._psize > limit - MIN_FREE_PAGES * self._psize:
            with self._read() as txn:
                free = in_file - self._pages_in_use(txn)
            size = max(limit, (in_file + max(0, MIN_FREE_PAGES - free)) * self._psize)
        self._env.set_mapsize(size)
        self._fitted_map = limit

    @locked
    def close(self) -> None:
        """Close open snapshots, write pending LRU touches, and close LMDB."""
        for snapshot in list(self._snapshots):
            snapshot.close()
        if self._env is not None:
            if not self.readonly and self._pending_touches:
                try:
                    self._write(lambda txn, counters: None)
                except StoreError:
                    logger.warning("could not flush LRU touches of %s", self.path)
            self._env.close()
            self._env = None
        if self._reg_key is not None:
            opening.unregister(self._reg_key)
            self._reg_key = None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- transactions ----------------------------------------------------------------------

    @contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        with self._lock:
            if self._env is None:
                raise StoreError("store is closed")
            try:
                txn = self._env.begin(buffers=True)
            except lmdb.MapResizedError:
                if self._snapshots:  # no remap under open views: read the snapshot's state
                    yield self._snapshots[-1].txn
                    return
                self._env.set_mapsize(0)  # another process grew the map: adopt its size
                txn = self._env.begin(buffers=True)
            try:
                yield txn
            finally:
                txn.abort()

    def _wait_for_snapshots(self) -> None:
        """Before growing the map (holding the lock): wait until no snapshot's views point
        into it. Snapshots are closed by the thread that opened them, which never writes while
        one is open (its writes are deferred), so only other threads wait here."""
        me = threading.get_ident()
        if any(s.owner == me for s in self._snapshots):
            raise StoreError("the LMDB map must grow while this thread holds a read snapshot")
        while self._snapshots:
            self._no_snapshots.wait()

    def _wait_for_older_snapshots(self) -> None:
        """Wait (holding the lock) until the snapshots other threads hold now are closed; new
        ones may open meanwhile (a wait for none open could starve behind engine steps)."""
        me = threading.get_ident()
        older = [s for s in self._snapshots if s.owner != me]
        while any(not s.closed for s in older):
            self._no_snapshots.wait()

    @locked
    def _write(self, fn):
        """Run ``fn(txn, counters)`` in one write transaction; when the map is full, grow it
        (unbounded) or make room in it (:meth:`_make_room`), and retry.

        ``fn`` must only touch the transaction (it may run more than once); the pending LRU
        touches are flushed in the same transaction.
        """
        if self.readonly:
            raise StoreReadOnlyError(f"store {self.path} is open read-only")
        if self._env is None:
            raise StoreError("store is closed")
        self._fit_map()
        rounds = 0
        while True:
            try:
                return self._commit(fn)
            except lmdb.MapFullError:
                if self._map_limit is not None:
                    rounds += 1
                    self._make_room(rounds)
                    continue
                new_size = self._env.info()["map_size"] * 2
                logger.info("LMDB map of %s full; growing to %d bytes", self.path, new_size)
                self._wait_for_snapshots()
                self._env.set_mapsize(new_size)
            except lmdb.MapResizedError:
                self._wait_for_snapshots()
                self._env.set_mapsize(0)

    def _commit(self, fn):
        """One write transaction of :meth:`_write`, committed; raises LMDB's errors."""
        with self._env.begin(write=True) as txn:
            counters = layout.Counters.read(txn, self._dbs["store"])
            self._flush_touches(txn, counters)
            result = fn(txn, counters)
            counters.write(txn, self._dbs["store"])
        self._pending_touches.clear()
        return result

    def _make_room(self, rounds: int) -> None:
        """After ``MDB_MAP_FULL`` in a bounded store (the ``rounds``-th time for one write):
        evict least-recently-used chunks no document owns, the write's pages at least (twice
        as many each round), in a transaction of their own, then commit once more (LMDB
        reuses a page two commits after it is freed) and wait for the snapshots open until
        then (pages a snapshot may still see are not reused). Raises :class:`StoreFullError`
        when nothing is left to evict."""
        limit = self._map_limit
        if rounds <= _MAX_ROOM_ROUNDS:
            try:
                evicted = self._commit(self._txn_evict_pages)
            except lmdb.MapFullError:
                # Even the eviction needs free pages, and the pages freed before are still
                # seen by a snapshot: wait for it, then write (and evict) again.
                self._wait_for_older_snapshots()
                return
            if evicted:
                self._room_pages *= 2
                self._note_evicted(evicted)
                with suppress(lmdb.MapFullError):
                    self._commit(lambda txn, counters: None)
                self._wait_for_older_snapshots()
                return
        raise StoreFullError(
            f"store {self.path} is full: its file reached its bound of {format_size(limit)} "
            "and nothing more can be evicted (the chunks in it belong to documents, or are "
            "being written); raise the limit (--store-max-bytes, store_max_bytes=, "
            "--request-cache-bytes) or delete documents (blendkv docs delete)"
        )

    def _txn_evict_pages(self, txn, counters: layout.Counters) -> list[tuple[bytes, int]]:
        """:meth:`_make_room`'s eviction: LRU chunks no document owns, ``_room_pages`` (32
        at least) pages' worth."""
        psize, want = self._psize, max(32, self._room_pages)
        victims, freed = [], 0
        for _, key in txn.cursor(db=self._dbs["lru"]):
            if freed >= want:
                break
            key = bytes(key)
            if _evictable(txn.get(key, db=self._dbs["chunks"])):
                victims.append(key)
                freed += value_pages(len(txn.get(key, db=self._dbs["values"])), psize)
        return self._txn_delete_victims(txn, counters, victims)

    def _flush_touches(self, txn, counters: layout.Counters) -> None:
        for key, when in self._pending_touches.items():
            self._txn_touch(txn, counters, key, when)

    @locked
    def _record_use(self, key: bytes, flush: bool = True) -> None:
        if self.readonly:
            return
        self._pending_touches[key] = time.time()
        self._pending_touches.move_to_end(key)
        if flush and len(self._pending_touches) >= self.touch_flush_every:
            self.flush()

    @locked
    def flush(self) -> None:
        """Write the batched LRU touches now."""
        if not self.readonly and self._pending_touches:
            self._write(lambda txn, counters: None)

    # ---- zero-copy readers and snapshots ---------------------------------------------------

    @contextmanager
    def reader(self) -> Iterator[ZeroCopyReader]:
        """A read transaction whose :meth:`ZeroCopyReader.view` returns zero-copy tensors.

        The views point into LMDB's read-only memory map: they are valid only inside the
        ``with`` block and must never be written (writing faults the process).
        """
        self._check_servable()
        with self._read() as txn:
            yield ZeroCopyReader(self, txn)

    @locked
    def snapshot(self) -> ReadSnapshot | None:
        """A read transaction to view values through until :meth:`ReadSnapshot.close`, from
        any thread (see :class:`ReadSnapshot`); None when another snapshot is open and the map
        must first be remapped to a size another process set (read with :meth:`get` then)."""
        self._check_servable()
        if self._env is None:
            raise StoreError("store is closed")
        try:
            txn = self._env.begin(buffers=True)
        except lmdb.MapResizedError:
            if self._snapshots:
                return None
            self._env.set_mapsize(0)
            txn = self._env.begin(buffers=True)
        snapshot = ReadSnapshot(self, txn)
        self._snapshots.append(snapshot)
        return snapshot

    @locked
    def _close_snapshot(self, snapshot: ReadSnapshot) -> None:
        if snapshot.closed:
            return
        snapshot.txn.abort()
        snapshot.closed = True
        self._snapshots.remove(snapshot)
        self._no_snapshots.notify_all()  # writers wait for every snapshot, or for older ones
        if self._snapshots:
            return
        if self._deferred_deletes and not self.readonly:
            keys, self._deferred_deletes = list(self._deferred_deletes), set()
            self.delete(keys)
        if len(self._pending_touches) >= self.touch_flush_every:
            self.flush()

    # ---- writing ---------------------------------------------------------------------------

    def _check_servable(self) -> None:
        if self.inspect_only:
            raise StoreError(f"store {self.path} was opened without a fingerprint (inspect mode)")

    @property
    def kv_codec(self) -> str:
        """How this store encodes K/V (:mod:`blendkv.store.codecs`); from its fingerprint."""
        return self.fingerprint.kv_codec

    def _check_shape(self, chunk: NewChunk) -> None:
        fp, kv = self.fingerprint, chunk.kv
        want = (fp.num_layers, 2, None, fp.num_kv_heads, fp.head_dim)
        pairs = zip(want, kv.shape, strict=False)
        if len(kv.shape) != 5 or any(w is not None and w != s for w, s in pairs):
            raise ValueError(
                f"chunk K/V shape {tuple(kv.shape)} does not match [num_layers={fp.num_layers}, "
                f"2, num_tokens, num_kv_heads={fp.num_kv_heads}, head_dim={fp.head_dim}]"
            )
        if chunk.token_ids and len(chunk.token_ids) != kv.shape[2]:
            raise ValueError(f"{len(chunk.token_ids)} token ids for {kv.shape[2]} K/V tokens")

    def put(self, key: bytes, kv: torch.Tensor, **meta) -> PutResult:
        """Store one chunk (see :class:`NewChunk` for the metadata keywords)."""
        return self.put_many([NewChunk(key, kv, **meta)])[0]

    @locked
    def put_many(self, chunks: Sequence[NewChunk]) -> list[PutResult]:
        """Store chunks in ONE transaction (all or none). Already-stored keys are only touched.

        Evicts least-recently-used chunks that no document owns (never ones of this batch) past
        ``max_bytes``; raises :class:`StoreFullError` (nothing written) if that is not enough.
        """
        self._check_servable()
        encoded = []
        for chunk in chunks:
            self._check_shape(chunk)
            encoded.append(
                fmt.encode_value(codecs.encode_for_store(self.kv_codec, chunk.kv, self.path))
            )
        new_bytes, new_pages = self._sizes([len(v) for v in encoded])
        if self.max_bytes is not None and not self._could_fit(new_bytes, new_pages):
            raise StoreFullError(
                f"store {self.path}: a write of {format_size(new_bytes)} is larger than the "
                f"store's limit of {format_size(self.max_bytes)} (less the free pages its "
                "file keeps); raise the limit (--store-max-bytes, store_max_bytes=)"
            )
        # Corrupt values a snapshot saw are deleted when it closes: a good copy replaces them
        # now, or that delete would drop it (the lock keeps snapshots from closing meanwhile).
        replace = {c.key for c in chunks} & self._deferred_deletes
        write = functools.partial(self._put_txn, chunks, encoded, replace, time.time())
        self._room_evicted = []
        self._room_pages = new_pages
        try:
            if self._map_limit is not None:
                self._evict_ahead(chunks, encoded)
            results, evicted = self._write(write)
        finally:
            self._room_pages = 0
        evicted = self._room_evicted + evicted
        self._deferred_deletes -= replace
        for key in replace:
            self._verified.discard(key)
        for key, _ in evicted:
            self.memory_tier.discard(key)
            self._verified.discard(key)
        if evicted:
            ids = tuple(cid for _, cid in evicted)
            results = [r._replace(evicted=ids) if i == 0 else r for i, r in enumerate(results)]
        return results

    def _evict_ahead(self, chunks: Sequence[NewChunk], encoded: list) -> None:
        """Make room for a write to a bounded store before it (see the module docstring): a
        read transaction says whether any is needed; the eviction is committed, then once more,
        so that the write can reuse the pages freed."""
        self._fit_map()
        keys = [c.key for c in chunks]
        with self._read() as txn:
            stored = [txn.get(key, db=self._dbs["chunks"]) is not None for key in keys]
            new = [len(v) for v, s in zip(encoded, stored, strict=True) if not s]
            new_bytes, new_pages = self._sizes(new)
            counters = layout.Counters.read(txn, self._dbs["store"])
            if max(self._excess(txn, counters, new_bytes, new_pages)) <= 0:
                return
        evict = functools.partial(
            self._txn_evict, protected=set(keys), new_bytes=new_bytes, new_pages=new_pages
        )
        try:
            evicted = self._commit(evict)
        except lmdb.MapFullError:
            return  # no page to copy into: the write's MDB_MAP_FULL makes room (_make_room)
        if evicted:
            self._note_evicted(evicted)
            with suppress(lmdb.MapFullError):
                self._commit(lambda txn, counters: None)

    def _note_evicted(self, evicted: list[tuple[bytes, int]]) -> None:
        """Chunks evicted outside the write that reports them (``PutResult.evicted``)."""
        self._room_evicted.extend(evicted)
        for key, _ in evicted:
            self.memory_tier.discard(key)
            self._verified.discard(key)

    def _put_txn(self, chunks, encoded, replace: set[bytes], now: float, txn, counters):
        """``put_many``'s transaction: insert new keys, touch stored ones (replace those in
        ``replace``), evict past ``max_bytes``; returns (results, evicted)."""
        results, batch_keys = [], set()
        for chunk, value in zip(chunks, encoded, strict=True):
            batch_keys.add(chunk.key)
            raw = txn.get(chunk.key, db=self._dbs["chunks"])
            if raw is not None and chunk.key in replace:
                self._txn_delete(txn, counters, chunk.key)
                raw = None
            if raw is not None:
                self._txn_touch(txn, counters, chunk.key, now)
                results.append(PutResult(ChunkMeta.from_json(raw).chunk_id, False, ()))
                continue
            cid = self._txn_insert(txn, counters, chunk, value, now)
            results.append(PutResult(cid, True, ()))
        evicted = self._txn_evict(txn, counters, batch_keys)
        if self.max_bytes is not None and counters.total_bytes > self.max_bytes:
            raise store_full_error(self.path, self.max_bytes, counters.total_bytes, encoded)
        return results, evicted

    @locked
    def delete(self, keys: Sequence[bytes]) -> list[int]:
        """Delete chunks by key in one transaction; returns the chunk ids that existed."""
        for key in keys:
            self.memory_tier.discard(key)
            self._verified.discard(key)

        def delete(txn, counters):
            return [self._txn_delete(txn, counters, bytes(k)) for k in keys]

        found = self._write(delete)
        return [cid for cid in found if cid is not None]

    def delete_document(self, doc_id: str) -> list[int]:
        """Delete every chunk of ``doc_id``; returns their chunk ids."""
        return self.delete([meta.key for meta in self.document_chunks(doc_id)])

    @locked
    def reassign(self, moves: Sequence[tuple[bytes, str, int]]) -> int:
        """Hand stored chunks to another document: ``(key, doc_id, position)`` each, in one
        transaction; returns how many were stored. A chunk shared by two documents is stored
        once, under the first; deleting that one hands the chunk to the other."""

        def reassign(txn, counters):
            return sum(self._txn_reassign(txn, bytes(k), d, p) for k, d, p in moves)

        return self._write(reassign)

    # ---- inside one write transaction ------------------------------------------------------
    # Each operation keeps every database of :mod:`.layout` and the counters in step; the
    # caller (:meth:`_write`) commits them together.

    def _txn_touch(self, txn, counters: layout.Counters, key: bytes, when: float) -> bool:
        """Make ``key`` the most recently used chunk; False if it is not stored."""
        dbs = self._dbs
        usage = txn.get(key, db=dbs["usage"])
        if usage is None:
            return False
        old_seq, _ = layout.unpack_usage(usage)
        txn.delete(layout.be64(old_seq), db=dbs["lru"])
        counters.lru_clock += 1
        txn.put(layout.be64(counters.lru_clock), key, db=dbs["lru"])
        txn.put(key, layout.pack_usage(counters.lru_clock, when), db=dbs["usage"])
        return True

    def _txn_insert(
        self, txn, counters: layout.Counters, chunk: NewChunk, value, now: float
    ) -> int:
        """Write a new chunk (value, metadata, id, LRU, document entry); returns its chunk id."""
        dbs = self._dbs
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

    def _txn_delete(self, txn, counters: layout.Counters, key: bytes) -> int | None:
        """Remove a chunk from every database; returns its chunk id, None if absent."""
        dbs = self._dbs
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

    def _txn_reassign(self, txn, key: bytes, doc_id: str, position: int) -> bool:
        """Make ``doc_id`` the owner of a stored chunk, at ``position`` of it (its metadata and
        the document index); False if the chunk is not stored."""
        dbs = self._dbs
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

    def _txn_evict(
        self,
        txn,
        counters: layout.Counters,
        protected: set[bytes],
        new_bytes: int = 0,
        new_pages: float = 0,
    ) -> list[tuple[bytes, int]]:
        """Delete least-recently-used evictable chunks (:func:`_evictable`, never ``protected``
        ones) until a write of ``new_bytes`` in ``new_pages`` (0: written already) fits
        (:meth:`_excess`); the caller checks whether that sufficed.

        Returns ``(key, chunk_id)`` of each evicted chunk, oldest first.
        """
        if self.max_bytes is None:
            return []
        over_bytes, over_pages = self._excess(txn, counters, new_bytes, new_pages)
        victims = []
        for _, key in txn.cursor(db=self._dbs["lru"]):
            if over_bytes <= 0 and over_pages <= 0:
                break
            key = bytes(key)
            if key not in protected and _evictable(txn.get(key, db=self._dbs["chunks"])):
                victims.append(key)
                nbytes = len(txn.get(key, db=self._dbs["values"]))
                over_bytes -= nbytes
                over_pages -= value_pages(nbytes, self._psize)
        return self._txn_delete_victims(txn, counters, victims)

    def _excess(
        self, txn, counters: layout.Counters, new_bytes: int, new_pages: float
    ) -> tuple[float, float]:
        """``(bytes, pages)`` to free for a write of ``new_bytes`` in ``new_pages``: the values
        past ``max_bytes``, and the pages in use past the map less the reserve of free pages
        (:func:`~blendkv.store.capacity.reserve_pages`; a bounded, writable store). Neither
        positive: none."""
        over_bytes = counters.total_bytes + new_bytes - self.max_bytes
        limit = self._map_limit
        if limit is None:
            return over_bytes, 0
        map_pages = limit // self._psize
        used = self._pages_in_use(txn) + new_pages
        return over_bytes, used + reserve_pages(map_pages) - map_pages

    def _could_fit(self, new_bytes: int, new_pages: float) -> bool:
        """Whether a write of ``new_bytes`` in ``new_pages`` fits the bound of an empty store."""
        limit = self._map_limit
        if new_bytes > self.max_bytes:
            return False
        if limit is None:
            return True
        map_pages = limit // self._psize
        return new_pages + reserve_pages(map_pages) <= map_pages

    def _sizes(self, value_lengths: list[int]) -> tuple[int, float]:
        """``(bytes, pages)`` of values of ``value_lengths`` bytes."""
        return sum(value_lengths), sum(value_pages(n, self._psize) for n in value_lengths)

    def _txn_delete_victims(
        self, txn, counters: layout.Counters, victims: list[bytes]
    ) -> list[tuple[bytes, int]]:
        evicted = []
        for key in victims:
            cid = self._txn_delete(txn, counters, key)
            evicted.append((key, cid))
            counters.evictions += 1
        return evicted

    def _pages_in_use(self, txn) -> int:
        """Pages of the map that ``txn`` uses: every database's B-tree and overflow pages,
        the main database's and the two meta pages (not the free list's own few pages)."""
        used = 2
        for db in (*self._dbs.values(), self._main_db):
            st = txn.stat(db)
            used += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return used

    # ---- reading ---------------------------------------------------------------------------

    def _checked_header(self, txn, key: bytes, buf) -> fmt.ValueHeader | None:
        once = self.verify_reads == "once"
        full = self.verify_reads is True or (once and key not in self._verified)
        try:
            header = fmt.check_value(buf, verify_checksum=full, codec=self.kv_codec)
            if once and full:
                if len(self._verified) > 1_000_000:  # bound the memory: just re-verify later
                    self._verified.clear()
                self._verified.add(key)
            return header
        except CorruptValueError as e:
            self.corrupt += 1
            self.misses += 1
            logger.warning("corrupt value for chunk %s in %s: %s", key.hex(), self.path, e)
            return None

    def _checked_value(self, txn, key: bytes) -> tuple[memoryview, fmt.ValueHeader] | None:
        """``key``'s stored bytes in ``txn`` and their checked header (checksum per
        ``verify_reads``); None on a miss or a corrupt value (both counted)."""
        buf = txn.get(key, db=self._dbs["values"])
        if buf is None:
            self.misses += 1
            self.lmdb_misses += 1
            return None
        header = self._checked_header(txn, key, buf)
        return None if header is None else (buf, header)

    def _on_corrupt(self, key: bytes) -> None:
        # Drop the entry so that a write-back can store a good copy (a miss is recomputed).
        if not self.readonly:
            self.delete([key])

    def get(self, key: bytes, *, skip_memory_tier: bool = False) -> ChunkKV | None:
        """The chunk's K/V (decoded to the model dtype), or None on a miss or a corrupt value.

        The tensor owns its memory (it is not tied to any LMDB transaction) but may be shared
        with the memory tier (codec ``none``): treat it as read-only.
        """
        value = self.get_encoded(key, skip_memory_tier=skip_memory_tier)
        return None if value is None else ChunkKV(key, decode_reference(value))

    @locked
    def get_encoded(
        self, key: bytes, *, skip_memory_tier: bool = False
    ) -> torch.Tensor | EncodedKV | None:
        """The chunk's value as stored: the raw tensor (codec ``none``) or its
        :class:`EncodedKV` (decode it while loading: nothing here decodes). None on a miss or a
        corrupt value. Owns its memory (pinned with ``pin_memory``), may be shared with the
        memory tier: read-only."""
        self._check_servable()
        use_tier = self.memory_tier.max_bytes and not skip_memory_tier
        value = self.memory_tier.get(key) if use_tier else None
        if value is None:
            value = self._load(key, None)
            if value is None:
                return None
            self.memory_tier.put(key, value)
        self.hits += 1
        self._record_use(key)
        return value

    def warm(self, key: bytes) -> bool:
        """Bring ``key``'s value into the OS page cache ahead of its use, without holding the
        store's lock while the disk reads (:meth:`ReadSnapshot.warm`); False on a miss."""
        snapshot = self.snapshot()
        if snapshot is None:  # the map must be remapped first: leave it to the read
            return False
        try:
            return snapshot.warm(key)
        finally:
            snapshot.close()

    @locked
    def read_into(self, key: bytes, out: torch.Tensor, *, admit: bool = False) -> bool:
        """Copy the chunk's K/V straight from the memory map into ``out`` (any device).

        ``out`` must have the stored shape and dtype. Returns False on a miss or corrupt value
        (``out`` may then hold partial data). ``admit`` also keeps a copy in the memory tier.
        """
        self._check_servable()
        tensor = self.memory_tier.get(key) if self.memory_tier.max_bytes else None
        if tensor is not None:
            if tuple(tensor.shape) != tuple(out.shape) or tensor.dtype != out.dtype:
                raise ValueError(
                    f"out is {out.dtype}{tuple(out.shape)}, stored {tensor.dtype}"
                    f"{tuple(tensor.shape)}"
                )
            out.copy_(decode_reference(tensor))
        else:
            value = self._load(key, out, keep_encoded=admit)
            if value is None:
                return False
            if admit and self.memory_tier.max_bytes:
                if not isinstance(value, EncodedKV):
                    value = out.detach().to("cpu", copy=True)
                self.memory_tier.put(key, value)
        self.hits += 1
        self._record_use(key)
        return True

    def _load(
        self, key: bytes, out: torch.Tensor | None, *, keep_encoded: bool = False
    ) -> torch.Tensor | EncodedKV | None:
        """Read from LMDB into ``out`` (decoded) or, without ``out``, a new tensor (codec
        ``none``) or :class:`EncodedKV` (copied out of the map). With ``out`` and
        ``keep_encoded`` an encoded value is also returned copied. None on miss/corruption."""
        corrupt_before = self.corrupt
        with self._read() as txn:
            found = self._checked_value(txn, key)
            if found is not None and found[1].codec != "none":
                buf, header = found
                value = fmt.decode_value(buf, header)
                if out is not None:
                    fmt.check_out(out, header)
                    out.copy_(decode_reference(value, out.dtype))
                    if not keep_encoded:
                        value = out
                if value is not out:
                    payload = torch.empty(
                        header.nbytes, dtype=torch.uint8, pin_memory=self.pin_memory
                    )
                    payload.copy_(fmt.payload_view(buf))
                    value = fmt.decode_payload(payload, header)
                out = value
            elif found is not None:
                buf, header = found
                if out is None:
                    out = torch.empty(header.shape, dtype=header.dtype, pin_memory=self.pin_memory)
                else:
                    fmt.check_out(out, header)
                src = fmt.payload_view(buf)
                if out.is_contiguous():
                    out.view(-1).view(torch.uint8).copy_(src)
                else:
                    out.copy_(src.view(header.dtype).view(header.shape))
        if found is None:
            if self.corrupt != corrupt_before:
                self._on_corrupt(key)
            return None
        self.lmdb_hits += 1
        return out

    # ---- membership and metadata -----------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        with self._read() as txn:
            return txn.get(key, db=self._dbs["chunks"]) is not None

    def contains_many(self, keys) -> list[bool]:
        """``key in self`` for each key, in one read transaction."""
        db = self._dbs["chunks"]
        with self._read() as txn:
            return [txn.get(key, db=db) is not None for key in keys]

    def __len__(self) -> int:
        with self._read() as txn:
            return txn.stat(self._dbs["chunks"])["entries"]

    def _meta(self, txn, key: bytes) -> ChunkMeta | None:
        raw = txn.get(key, db=self._dbs["chunks"])
        if raw is None:
            return None
        usage = txn.get(key, db=self._dbs["usage"])
        return ChunkMeta.from_json(raw, layout.unpack_usage(usage)[1] if usage else 0.0)

    def get_meta(self, key: bytes) -> ChunkMeta | None:
        """The metadata of the chunk stored under ``key``; None when it is not stored."""
        with self._read() as txn:
            return self._meta(txn, key)

    def key_for_id(self, chunk_id: int) -> bytes | None:
        """The key of the chunk with this id; None when it is not stored."""
        with self._read() as txn:
            key = txn.get(layout.be64(chunk_id), db=self._dbs["ids"])
            return bytes(key) if key is not None else None

    def meta_for_id(self, chunk_id: int) -> ChunkMeta | None:
        """The metadata of the chunk with this id; None when it is not stored."""
        with self._read() as txn:
            key = txn.get(layout.be64(chunk_id), db=self._dbs["ids"])
            return self._meta(txn, bytes(key)) if key is not None else None

    def chunk_ids(self) -> list[int]:
        """The ids of every stored chunk, ascending."""
        with self._read() as txn:
            return [layout.from_be64(k) for k, _ in txn.cursor(db=self._dbs["ids"])]

    def iter_meta(self) -> Iterator[ChunkMeta]:
        """The metadata of every stored chunk (in one read transaction)."""
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
                if _evictable(raw):
                    total += ChunkMeta.from_json(raw).nbytes
        return total

    def lru_keys(self) -> list[bytes]:
        """Keys from least to most recently used (flushes pending touches first)."""
        self.flush()
        with self._read() as txn:
            return [bytes(k) for _, k in txn.cursor(db=self._dbs["lru"])]

    # ---- health ----------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        """The store's counters (:class:`~blendkv.store.StoreStats`)."""
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


_MAX_ROOM_ROUNDS = 16  # for one write: the write's pages, doubling (everything by then)


def _evictable(raw_meta) -> bool:
    """Whether a chunk (its ChunkMeta JSON) may be evicted: only chunks no document owns (K/V
    computed at query time). The compact JSON spells a missing owner exactly so, and a quote
    inside a string value is escaped, so the byte test cannot match the chunk's text."""
    return b'"doc_id":null' in bytes(raw_meta)
