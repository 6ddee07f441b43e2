"""Opens the chunk-K/V store backend a location names: a Redis URL or an LMDB directory."""

from __future__ import annotations

import os
from pathlib import Path

from .base import ChunkKVStore
from .errors import StoreFormatError
from .fingerprint import ModelFingerprint
from .kv_store import KVStore
from .redis_store import RedisKVStore, is_redis_url

# Options only an LMDB store takes; dropped when the location is a Redis URL.
_LMDB_ONLY = ("map_size", "verify_reads", "sync")


def open_kv_store(
    location: str | os.PathLike, fingerprint: ModelFingerprint | None = None, **kwargs
) -> ChunkKVStore:
    """A chunk-K/V store at ``location``: a ``redis://host:port/db`` URL opens a
    :class:`~blendkv.store.redis_store.RedisKVStore`, anything else an LMDB directory
    (:class:`~blendkv.store.KVStore`). ``kwargs`` go to the backend's constructor."""
    if is_redis_url(location):
        for name in _LMDB_ONLY:
            kwargs.pop(name, None)
        return RedisKVStore(location, fingerprint, **kwargs)
    return KVStore(location, fingerprint, **kwargs)


def stored_fingerprint(location: str | os.PathLike) -> ModelFingerprint | None:
    """The fingerprint an existing store at ``location`` was built with; None when there is
    no store there yet. Read without a model (inspect mode), so a caller can load the model
    the store needs, e.g. in the dtype it was built with."""
    if is_redis_url(location):
        try:
            store = RedisKVStore(str(location), None, create=False, readonly=True)
        except StoreFormatError:
            return None  # nothing there yet (or unreadable: the real open will say so)
    else:
        if not (Path(location) / "data.mdb").exists():
            return None
        store = KVStore(location, None, readonly=True, memory_tier_bytes=0)
    try:
        return store.fingerprint
    finally:
        store.close()
