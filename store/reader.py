"""Zero-copy reads of LMDB values inside one read transaction (:meth:`KVStore.reader`)."""

from __future__ import annotations

from . import format as fmt
from .records import ChunkKV


class ZeroCopyReader:
    """Zero-copy access inside one read transaction (see :meth:`KVStore.reader`)."""

    def __init__(self, store, txn) -> None:
        self._store, self._txn = store, txn

    def view(self, key: bytes) -> ChunkKV | None:
        store = self._store
        buf = self._txn.get(key, db=store._dbs["values"])
        if buf is None:
            store.misses += 1
            store.lmdb_misses += 1
            return None
        header = store._checked_header(self._txn, key, buf)
        if header is None:
            return None
        store.hits += 1
        store.lmdb_hits += 1
        tensor = fmt.payload_view(buf).view(header.dtype).view(header.shape)
        return ChunkKV(key, tensor)
