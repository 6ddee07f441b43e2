"""The chunk-K/V store on a real redis-server and a real Redis Cluster: the same interface and
bytes as LMDB."""

from __future__ import annotations

import pytest
import torch
from redis_server import RedisServer
from store_helpers import key_of, make_fingerprint, make_kv, same_bits

from blendkv.store import (
    ChunkKVStore,
    FingerprintMismatchError,
    KVStore,
    NewChunk,
    StoreError,
    open_kv_store,
)
from blendkv.store import format as fmt
from blendkv.store.redis_store import RedisKVStore


@pytest.fixture(params=["server", "cluster"])
def redis_url(request):
    """The same tests on one redis-server and on a 3-master Redis Cluster (any node's URL)."""
    server = request.getfixturevalue(
        "redis_server" if request.param == "server" else "redis_cluster"
    )
    server.flush()
    return server.url


def test_round_trip_equals_lmdb_bit_for_bit(redis_url, tmp_path, fp):
    chunks = [
        NewChunk(
            key_of(i), make_kv(i, num_tokens=3 + i), text=f"t{i}", token_ids=tuple(range(3 + i))
        )
        for i in range(5)
    ]
    with (
        KVStore(tmp_path / "lmdb", fp) as lmdb,
        open_kv_store(redis_url, fp, part_bytes=100) as red,
    ):
        assert isinstance(red, RedisKVStore)
        assert [r.inserted for r in red.put_many(chunks)] == [True] * 5
        lmdb.put_many(chunks)
        assert [r.inserted for r in red.put_many(chunks[:1])] == [False]  # content-addressed
        for c in chunks:
            a, b = lmdb.get(c.key).kv, red.get(c.key).kv
            assert same_bits(a, b) and same_bits(b, c.kv)
            out = torch.empty_like(c.kv)
            assert red.read_into(c.key, out) and same_bits(out, c.kv)
            # The stored bytes are the LMDB format, split into parts of <= 100 bytes.
            raw = red.client.get(red._chunk(c.key, "m"))
            assert b'"parts":' in raw
        meta = red.meta_for_id(red.get_meta(chunks[2].key).chunk_id)
        assert meta.text == "t2" and meta.token_ids == (0, 1, 2, 3, 4)
        assert len(red) == 5 and red.verify().ok, red.verify()
        assert red.delete([chunks[0].key]) == [1] and chunks[0].key not in red


def test_contains_many_asks_once_and_agrees_with_in(redis_url, tmp_path, fp):
    """One pipeline of EXISTS (one round trip) for what the memory tier does not hold, the
    same answers as ``key in store`` on LMDB, Redis and the layered store over both."""
    from blendkv.store.layered import LayeredKVStore

    chunks = [NewChunk(key_of(i), make_kv(i)) for i in range(4)]
    keys = [key_of(i) for i in (3, 9, 0, 7, 1)]
    want = [True, False, True, False, True]
    with (
        KVStore(tmp_path / "lmdb", fp, max_bytes=1 << 30) as lmdb,
        open_kv_store(redis_url, fp, memory_tier_bytes=1 << 20) as red,
    ):
        for s in (lmdb, red):
            s.put_many(chunks[:2])
            s.put_many(chunks[3:])
        red.get(key_of(0))  # in the memory tier: not asked of Redis
        calls = []
        original = red.client.pipeline
        red.client.pipeline = lambda **kw: calls.append(kw) or original(**kw)
        assert red.contains_many(keys) == want
        assert len(calls) == 1
        red.client.pipeline = original
        assert want == [k in red for k in keys]
        assert lmdb.contains_many(keys) == want and lmdb.contains_many([]) == []
        main = KVStore(tmp_path / "main", fp)
        main.put_many([chunks[3]])
        layered = LayeredKVStore(main, lmdb)  # found in either
        lmdb.put_many([NewChunk(key_of(9), make_kv(9))])
        assert layered.contains_many(keys) == [True, True, True, False, True]
        main.close()


def test_every_backend_class_defines_every_protocol_method():
    """Runs without a redis-server: the classes themselves have every declared method."""
    declared = [n for n, v in vars(ChunkKVStore).items() if callable(v) and not n.startswith("_")]
    for backend in (KVStore, RedisKVStore):
        missing = [n for n in declared if not callable(getattr(backend, n, None))]
        assert not missing, f"{backend.__name__} lacks {missing}"
        assert isinstance(backend.reads_in_place, bool)


def test_both_backends_implement_the_store_protocol(redis_url, tmp_path, fp):
    """Every method ``ChunkKVStore`` declares exists on both backends; what Redis cannot do
    (view in place, warm a page cache) it says through the protocol, not by lacking it."""
    declared = [n for n, v in vars(ChunkKVStore).items() if callable(v) and not n.startswith("_")]
    assert {"get", "read_into", "warm", "snapshot"} <= set(declared)
    chunk = NewChunk(key_of(1), make_kv(1))
    with (
        open_kv_store(tmp_path / "lmdb", fp, memory_tier_bytes=0) as lmdb,
        open_kv_store(redis_url, fp, memory_tier_bytes=0) as red,
    ):
        for store in (lmdb, red):
            assert isinstance(store, ChunkKVStore)
            assert all(callable(getattr(store, name)) for name in declared)
            store.put_many([chunk])
        assert lmdb.reads_in_place and lmdb.warm(chunk.key) and not lmdb.warm(key_of(2))
        snapshot = lmdb.snapshot()
        assert same_bits(snapshot.view(chunk.key).kv, chunk.kv)
        snapshot.close()
        assert not red.reads_in_place
        assert red.warm(chunk.key) is False and red.snapshot() is None


def test_a_second_process_store_sees_the_same_chunks_and_refuses_other_models(redis_url, fp):
    with open_kv_store(redis_url, fp, memory_tier_bytes=0) as a:
        a.put_many([NewChunk(key_of(1), make_kv(1), doc_id="d", position=0)])
    with open_kv_store(redis_url, fp, memory_tier_bytes=0) as b:
        assert same_bits(b.get(key_of(1)).kv, make_kv(1))
        assert [m.key for m in b.document_chunks("d")] == [key_of(1)]
    other = make_fingerprint(weights_hash="x" * 8, head_dim=8)
    with pytest.raises(FingerprintMismatchError) as err:
        open_kv_store(redis_url, other)
    assert "weights_hash" in str(err.value) and "head_dim" in str(err.value)


def test_a_chunk_two_processes_store_at_once_is_stored_once(redis_url, fp):
    """Two writers of the same chunk (ingest workers sharing a chunk): B stores it between A's
    check and A's write; A's write is refused (WATCH) and A reports B's chunk."""
    with (
        open_kv_store(redis_url, fp, memory_tier_bytes=0) as a,
        open_kv_store(redis_url, fp, memory_tier_bytes=0) as b,
    ):
        incr = a.client.incr
        theirs = []

        def b_writes_first(name):  # runs between A's WATCH and A's MULTI
            if not theirs:
                theirs.extend(b.put_many([NewChunk(key_of(1), make_kv(1), doc_id="d")]))
            return incr(name)

        a.client.incr = b_writes_first
        [mine] = a.put_many([NewChunk(key_of(1), make_kv(1), doc_id="d")])
        assert theirs[0].inserted and not mine.inserted
        assert mine.chunk_id == theirs[0].chunk_id
        assert len(a) == 1 and a.verify().ok
        assert same_bits(a.get(key_of(1)).kv, make_kv(1))


def test_corrupted_value_is_a_checksum_miss(redis_url, fp):
    with open_kv_store(redis_url, fp, memory_tier_bytes=0) as s:
        s.put_many([NewChunk(key_of(2), make_kv(2))])
        part = s._chunk(key_of(2), "p:0")
        s.client.setrange(part, fmt.HEADER_SIZE + 5, b"\xff\xfe")
        report = s.verify()
        assert [p.kind for p in report.problems] == ["corrupt_value"]
        assert s.get(key_of(2)) is None and s.corrupt == 1
        assert key_of(2) not in s  # dropped, so a write-back can store a good copy


def test_eviction_under_maxmemory_is_misses_not_errors(tmp_path, fp):
    server = RedisServer(tmp_path, maxmemory="3mb").start()
    try:
        with open_kv_store(server.url, fp, memory_tier_bytes=0, part_bytes=4096) as s:
            n = 200  # 200 x 16 KiB = 3.2 MiB of values into 3 MiB: Redis must evict
            for i in range(n):
                s.put_many([NewChunk(key_of(i), make_kv(i, num_tokens=512))])
            # A small chunk (one part) written last and read at once is still there. (Most of
            # the big ones lose a part: approximate LRU samples keys, not chunks.)
            s.put_many([NewChunk(key_of(n), make_kv(n))])
            assert same_bits(s.get(key_of(n)).kv, make_kv(n))
            found = [s.get(key_of(i)) for i in range(n)]
            hits = [i for i, f in enumerate(found) if f is not None]
            assert len(hits) < n
            assert all(same_bits(found[i].kv, make_kv(i, num_tokens=512)) for i in hits)
            assert s.stats().evictions > 0
    finally:
        server.kill()


def test_lost_connection_reads_miss_writes_fail_then_reconnects(tmp_path, fp):
    server = RedisServer(tmp_path).start()
    s = open_kv_store(server.url, fp, memory_tier_bytes=0, socket_timeout=1.0)
    s.put_many([NewChunk(key_of(1), make_kv(1))])
    server.kill()
    assert s.get(key_of(1)) is None and key_of(1) not in s
    assert s.contains_many([key_of(1), key_of(2)]) == [False, False]
    with pytest.raises(StoreError, match="unreachable"):
        s.put_many([NewChunk(key_of(2), make_kv(2))])
    assert s.connection_errors >= 3
    assert [p.kind for p in s.verify().problems] == ["unreachable"]
    server.start()  # restarted empty: the fingerprint record is written again
    s.put_many([NewChunk(key_of(2), make_kv(2))])
    assert same_bits(s.get(key_of(2)).kv, make_kv(2))
    with pytest.raises(FingerprintMismatchError):
        open_kv_store(server.url, make_fingerprint(dtype="float32"))
    s.close()
    server.kill()
