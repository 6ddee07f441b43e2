"""``stored_fingerprint``: the fingerprint a store was built with, read without a model (what
``dtype="auto"`` follows), for LMDB directories and Redis URLs; None where no store is yet."""

from __future__ import annotations

from store_helpers import make_fingerprint

from blendkv.store import KVStore, open_kv_store
from blendkv.store.backends import stored_fingerprint


def test_lmdb(tmp_path, fp):
    assert stored_fingerprint(tmp_path / "store") is None
    assert not (tmp_path / "store").exists()  # reading created nothing
    KVStore(tmp_path / "store", fp).close()
    assert stored_fingerprint(tmp_path / "store") == fp
    with KVStore(tmp_path / "store", fp) as s:  # the read left nothing open or registered
        assert s.fingerprint == fp


def test_redis(redis_server):
    redis_server.flush()
    fp = make_fingerprint(dtype="float16")
    assert stored_fingerprint(redis_server.url) is None
    open_kv_store(redis_server.url, fp, memory_tier_bytes=0).close()
    assert stored_fingerprint(redis_server.url) == fp
