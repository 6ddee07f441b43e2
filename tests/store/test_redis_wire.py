"""Chunk values read from a real redis-server over the store's own RESP connections
(:mod:`blendkv.store.redis_wire`): the bytes redis-py reads, part boundaries anywhere against
the 64 KiB receives, misses that keep the connection in step, a database and a password, and
threads reading side by side."""

from __future__ import annotations

import json
import threading

import pytest
from redis_server import RedisServer
from store_helpers import key_of, make_kv, same_bits

from blendkv.store import NewChunk, open_kv_store
from blendkv.store.redis_store import _joined


@pytest.fixture
def redis_url(redis_server):
    redis_server.flush()
    return redis_server.url


def _parts(store, key):
    """The names of a chunk's parts and its value's size, from its metadata record."""
    record = json.loads(store.client.get(store._chunk(key, "m")))
    names = [store._chunk(key, f"p:{i}") for i in range(record["parts"])]
    return names, record["nbytes"]


@pytest.mark.parametrize("part_bytes", [7, 50_001, 8 << 20])
def test_bulk_reads_equal_redis_py_reads(redis_url, fp, part_bytes):
    sizes = [1, 300, 4096]  # tokens: 64 bytes to ~260 KB of K/V
    chunks = [NewChunk(key_of(i), make_kv(i, num_tokens=n)) for i, n in enumerate(sizes)]
    with open_kv_store(redis_url, fp, memory_tier_bytes=0, part_bytes=part_bytes) as s:
        assert s._bulk is not None
        s.put_many(chunks)
        for c in chunks:
            names, nbytes = _parts(s, c.key)
            assert s._bulk.read(names, nbytes) == _joined(s.client.mget(names))
            assert same_bits(s.get(c.key).kv, c.kv)
            assert s._bulk.read(names, nbytes + 1) is None  # sizes that do not add up
            assert s._bulk.read(names, nbytes - 1) is None  # ... either way
        assert same_bits(s.get(chunks[0].key).kv, chunks[0].kv)  # still in step


def test_a_missing_part_is_a_miss_and_the_connection_stays_in_step(redis_url, fp):
    with open_kv_store(redis_url, fp, memory_tier_bytes=0, part_bytes=1000) as s:
        s.put_many([NewChunk(key_of(i), make_kv(i, num_tokens=64)) for i in range(2)])
        s.client.delete(s._chunk(key_of(0), "p:1"))  # evicted behind the store's back
        assert s.get(key_of(0)) is None and s.misses == 1
        conn = s._bulk._local.conns.get(None)
        assert same_bits(s.get(key_of(1)).kv, make_kv(1, num_tokens=64))
        assert s._bulk._local.conns.get(None) is conn and s.connection_errors == 0
        assert key_of(0) not in s  # its remains were deleted


def test_a_database_and_a_password(tmp_path, fp):
    server = RedisServer(tmp_path).start()
    try:
        import redis

        redis.Redis(port=server.port).config_set("requirepass", "sesame")
        url = f"redis://:sesame@127.0.0.1:{server.port}/3"
        with open_kv_store(url, fp, memory_tier_bytes=0, part_bytes=999) as s:
            s.put_many([NewChunk(key_of(5), make_kv(5, num_tokens=40))])
            assert same_bits(s.get(key_of(5)).kv, make_kv(5, num_tokens=40))
            client = redis.Redis(port=server.port, password="sesame", db=3)
            assert client.exists(s._chunk(key_of(5), "m"))  # it went to database 3
    finally:
        server.kill()


def test_threads_read_side_by_side(redis_url, fp):
    with open_kv_store(redis_url, fp, memory_tier_bytes=0, part_bytes=4096) as s:
        s.put_many([NewChunk(key_of(i), make_kv(i, num_tokens=100)) for i in range(8)])
        wrong = []

        def read(offset: int) -> None:
            for r in range(20):
                i = (offset + r) % 8
                if not same_bits(s.get(key_of(i)).kv, make_kv(i, num_tokens=100)):
                    wrong.append(i)

        threads = [threading.Thread(target=read, args=(t,)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not wrong and len(s._bulk._open) == 3  # one connection per thread


def test_a_restarted_server_is_read_from_again_at_once(tmp_path, fp):
    """The connection a thread read through before the restart is stale: the read is tried
    once more on a new one instead of failing (a miss and a recompute)."""
    server = RedisServer(tmp_path).start()
    try:
        with open_kv_store(server.url, fp, memory_tier_bytes=0, socket_timeout=2.0) as s:
            s.put_many([NewChunk(key_of(1), make_kv(1))])
            assert same_bits(s.get(key_of(1)).kv, make_kv(1))  # its connection is made
            stale = s._bulk._local.conns.get(None)
            server.kill()
            server.start()  # empty
            s.put_many([NewChunk(key_of(1), make_kv(1))])  # redis-py reconnects for writes
            errors = s.connection_errors
            assert same_bits(s.get(key_of(1)).kv, make_kv(1))
            assert s.connection_errors == errors and s._bulk._local.conns.get(None) is not stale
    finally:
        server.kill()
