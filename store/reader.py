"""Zero-copy reads of LMDB values: inside one ``with`` block (:meth:`KVStore.reader`) or for
the length of an engine step (:meth:`KVStore.snapshot`).

A view is a tensor over LMDB's read-only memory map: valid while its read transaction is open,
never to be written (writing faults the process). LMDB may not remap (grow the map) while a
transaction of this process is open, so the store counts its open snapshots and a write that
must grow the map waits for them to close.
"""

from __future__ import annotations

import threading

from . import format as fmt
from .codecs import decode_reference
from .errors import CorruptValueError, StoreError
from .records import ChunkKV


def _view_value(store, txn, key: bytes):
    """``key``'s stored value, zero-copy: a tensor (codec ``none``) or an ``EncodedKV``."""
    found = store._checked_value(txn, key)
    if found is None:
        return None
    buf, header = found
    store.hits += 1
    store.lmdb_hits += 1
    return fmt.decode_value(buf, header)


def _view(store, txn, key: bytes) -> ChunkKV | None:
    """``key``'s value as a zero-copy tensor (an encoded value is decoded: a copy)."""
    value = _view_value(store, txn, key)
    return None if value is None else ChunkKV(key, decode_reference(value))


class ZeroCopyReader:
    """Zero-copy access inside one read transaction (see :meth:`KVStore.reader`)."""

    def __init__(self, store, txn) -> None:
        self._store, self._txn = store, txn

    def view(self, key: bytes) -> ChunkKV | None:
        return _view(self._store, self._txn, key)


class ReadSnapshot:
    """A read transaction held open across threads (py-lmdb opens with ``MDB_NOTLS``), made
    by :meth:`KVStore.snapshot`: the engine takes one per step, views the step's chunks through
    it, and its loading thread reads them layer by layer while the forward runs; the snapshot
    also keeps the viewed values alive if a concurrent write evicts them.

    While it is open the store defers what would write from the viewing thread (LRU touches,
    deleting a corrupt value) to :meth:`close`. Close it when every view is done with.
    """

    def __init__(self, store, txn) -> None:
        self._store, self.txn = store, txn
        self.owner = threading.get_ident()
        self.closed = False

    def view(self, key: bytes) -> ChunkKV | None:
        """The chunk's K/V as a zero-copy, read-only tensor; None on a miss or a corrupt value
        (counted like :meth:`KVStore.get`)."""
        return self._locked_read(_view, key)

    def view_encoded(self, key: bytes):
        """The chunk's value as stored, zero-copy over the map: a tensor (codec ``none``) or
        an :class:`~blendkv.store.codecs.EncodedKV` whose tensors view the map (decode it
        while loading). None on a miss or a corrupt value; valid until :meth:`close`."""
        return self._locked_read(_view_value, key)

    def _locked_read(self, read, key: bytes):
        """``read(store, txn, key)`` under the store's lock; a value found corrupt is deleted
        when the snapshot closes, a hit is recorded as a use."""
        store = self._store
        with store._lock:
            if self.closed:
                raise StoreError("the read snapshot is closed")
            corrupt_before = store.corrupt
            value = read(store, self.txn, key)
            if value is None:
                if store.corrupt != corrupt_before:
                    store._deferred_deletes.add(key)
                return None
            store._record_use(key, flush=False)
            return value

    def warm(self, key: bytes) -> bool:
        """Fault ``key``'s value into the OS page cache (py-lmdb's get touches every page of a
        value) and check its checksum if this store has not yet (``verify_reads="once"``), so
        that a later read finds it in memory, checked. The store's lock is not held while the
        disk reads. False on a miss or a corrupt value (left to the read that uses it)."""
        store = self._store
        if self.closed:
            raise StoreError("the read snapshot is closed")
        buf = self.txn.get(key, db=store._dbs["values"])
        if buf is None:
            return False
        if store.verify_reads == "once" and key not in store._verified:
            try:
                fmt.check_value(buf, verify_checksum=True)
            except CorruptValueError:
                return False
            with store._lock:
                store._verified.add(key)
        return True

    def close(self) -> None:
        self._store._close_snapshot(self)

    def __enter__(self) -> ReadSnapshot:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
