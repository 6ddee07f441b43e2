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
from contextlib import contextmanager
from pathlib import Path

import lmdb
import torch

from blendkv.sizes import format_size

from . import codecs, layout, opening
from . import format as fmt
from .capacity import store_full_error
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
        max_bytes: capacity in value bytes, saved in the store (``None``: the saved one, if
            any). Past it, the least-recently-used chunks no document owns are evicted, then a
            write raises :class:`StoreFullError`.
        map_size: initial LMDB map size in bytes; it grows automatically when full.
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
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
        self._lock = threading.RLock()
        self.path = Path(path)
        self.readonly = readonly
        self.max_bytes = max_bytes
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
        try:
            self._env = opening.open_env(
                self.path, readonly=self.readonly, map_size=map_size, sync=sync
            )
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
        except BaseException:
            self.close()
            raise

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

    @locked
    def _write(self, fn):
        """Run ``fn(txn, counters)`` in one write transaction; grow the map and retry when full.

        ``fn`` must only touch the transaction (it may run more than once); the pending LRU
        touches are flushed in the same transaction.
        """
        if self.readonly:
            raise StoreReadOnlyError(f"store {self.path} is open read-only")
        if self._env is None:
            raise StoreError("store is closed")
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    counters = layout.Counters.read(txn, self._dbs["store"])
                    self._flush_touches(txn, counters)
                    result = fn(txn, counters)
                    counters.write(txn, self._dbs["store"])
                self._pending_touches.clear()
                return result
            except lmdb.MapFullError:
                new_size = self._env.info()["map_size"] * 2
                logger.info("LMDB map of %s full; growing to %d bytes", self.path, new_size)
                self._wait_for_snapshots()
                self._env.set_mapsize(new_size)
            except lmdb.MapResizedError:
                self._wait_for_snapshots()
                self._env.set_mapsize(0)

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
        if self._snapshots:
            return
        self._no_snapshots.notify_all()
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
        new_bytes = sum(len(v) for v in encoded)
        if self.max_bytes is not None and new_bytes > self.max_bytes:
            raise StoreFullError(
                f"store {self.path}: a write of {format_size(new_bytes)} is larger than the "
                f"store's limit of {format_size(self.max_bytes)}; raise the limit "
                "(--store-max-bytes, store_max_bytes=)"
            )
        # Corrupt values a snapshot saw are deleted when it closes: a good copy replaces them
        # now, or that delete would drop it (the lock keeps snapshots from closing meanwhile).
        replace = {c.key for c in chunks} & self._deferred_deletes
        write = functools.partial(self._put_txn, chunks, encoded, replace, time.time())
        results, evicted = self._write(write)
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
        self, txn, counters: layout.Counters, protected: set[bytes]
    ) -> list[tuple[bytes, int]]:
        """Delete least-recently-used evictable chunks (:func:`_evictable`, never ``protected``
        ones) until under ``max_bytes``; the caller checks whether that sufficed.

        Returns ``(key, chunk_id)`` of each evicted chunk, oldest first.
        """
        if self.max_bytes is None or counters.total_bytes <= self.max_bytes:
            return []
        victims, freed = [], 0
        for _, key in txn.cursor(db=self._dbs["lru"]):
            if counters.total_bytes - freed <= self.max_bytes:
                break
            key = bytes(key)
            if key not in protected and _evictable(txn.get(key, db=self._dbs["chunks"])):
                victims.append(key)
                freed += len(txn.get(key, db=self._dbs["values"]))
        evicted = []
        for key in victims:
            cid = self._txn_delete(txn, counters, key)
            evicted.append((key, cid))
            counters.evictions += 1
        return evicted

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


def _evictable(raw_meta) -> bool:
    """Whether a chunk (its ChunkMeta JSON) may be evicted: only chunks no document owns (K/V
    computed at query time). The compact JSON spells a missing owner exactly so, and a quote
    inside a string value is escaped, so the byte test cannot match the chunk's text."""
    return b'"doc_id":null' in bytes(raw_meta)
