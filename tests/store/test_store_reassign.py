"""``reassign``: a stored chunk handed to another document (owner and position), in LMDB and
in Redis alike; what deleting the first of two documents that share a chunk relies on."""

from __future__ import annotations

import pytest
from store_helpers import key_of, make_kv

from blendkv.store import KVStore, NewChunk, open_kv_store


def _fill(store) -> None:
    store.put_many(
        [NewChunk(key_of(i), make_kv(i), text=f"t{i}", doc_id="a", position=i) for i in range(3)]
    )


def _check(store) -> None:
    assert store.reassign([(key_of(1), "b", 4), (key_of(99), "b", 0)]) == 1  # 99: not stored
    assert [m.position for m in store.document_chunks("a")] == [0, 2]
    [moved] = store.document_chunks("b")
    assert (moved.key, moved.doc_id, moved.position, moved.text) == (key_of(1), "b", 4, "t1")
    assert store.get_meta(key_of(1)).doc_id == "b"
    assert store.verify().ok, store.verify()
    ids = [store.get_meta(key_of(i)).chunk_id for i in (0, 2)]
    assert sorted(store.delete_document("a")) == ids
    assert key_of(1) in store and len(store) == 1


def test_reassign_lmdb(store):
    _fill(store)
    _check(store)


def test_reassign_lmdb_in_inspect_mode(store_path, fp):
    """``blendkv docs delete`` opens the store without a model (no fingerprint)."""
    with KVStore(store_path, fp) as store:
        _fill(store)
    with KVStore(store_path, None) as store:
        _check(store)


def test_reassign_redis(redis_server, fp):
    redis_server.flush()
    store = open_kv_store(redis_server.url, fp)
    try:
        _fill(store)
        _check(store)
    finally:
        store.close()


def test_reassign_refused_read_only(store_path, fp):
    with KVStore(store_path, fp) as store:
        _fill(store)
    with KVStore(store_path, fp, readonly=True) as store, pytest.raises(Exception, match="only"):
        store.reassign([(key_of(1), "b", 0)])
