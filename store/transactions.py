"""The LMDB transactions of a :class:`~blendkv.store.kv_store.KVStore`: reads, writes that grow
the map when it is full, batched LRU touches, and zero-copy readers and snapshots.

A mixin over the store's environment (``self._env``), lock (``self._lock``) and named
databases (``self._dbs``). LMDB may not remap while a transaction of this process is open; a
snapshot stays open across threads for a whole engine step, so a write that must grow the map
waits for the open snapshots (:meth:`StoreTransactions._wait_for_snapshots`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import lmdb

from . import layout, txn_ops
from .errors import StoreError, StoreReadOnlyError
from .locking import locked
from .reader import ReadSnapshot, ZeroCopyReader

logger = logging.getLogger(__name__)


class StoreTransactions:
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
            txn_ops.touch(txn, self._dbs, counters, key, when)

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
