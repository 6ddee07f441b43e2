"""KVStore round trips, metadata, LRU eviction, map growth, memory tier."""

from __future__ import annotations

import pytest
import torch
from store_helpers import ANCHOR, key_of, make_fingerprint, make_kv, same_bits

from blendkv.store.errors import StoreFullError
from blendkv.store.fingerprint import ModelFingerprint
from blendkv.store.keys import chunk_key
from blendkv.store.kv_store import KVStore
from blendkv.store.memory_tier import MemoryTier
from blendkv.store.records import NewChunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bit_exact(store, dtype):
    kv = make_kv(0, num_tokens=13, dtype=dtype)
    kv.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-8]).to(dtype)
    key = key_of(0)
    result = store.put(key, kv, text="hello", token_ids=range(13), doc_id="doc", position=3)
    assert result.inserted and result.chunk_id == 0

    got = store.get(key)
    assert same_bits(got.kv, kv) and got.num_tokens == 13
    assert same_bits(got.k, kv[:, 0]) and same_bits(got.v, kv[:, 1])
    out = torch.full_like(kv, 7)
    store.memory_tier.clear()
    assert store.read_into(key, out) and same_bits(out, kv)
    with store.reader() as reader:
        assert same_bits(reader.view(key).kv, kv)
    meta = store.get_meta(key)
    assert (meta.text, meta.doc_id, meta.position, meta.num_tokens) == ("hello", "doc", 3, 13)
    assert meta.token_ids == tuple(range(13)) and meta.dtype == str(dtype)[6:]


def test_survives_reopen_and_ids_are_persistent(store_path, fp):
    with KVStore(store_path, fp) as s:
        ids = [s.put(key_of(i), make_kv(i)).chunk_id for i in range(3)]
        assert s.put(key_of(1), make_kv(1)) == (1, False, ())  # content-addressed: no rewrite
    with KVStore(store_path, fp) as s:
        assert ids == [0, 1, 2] and s.chunk_ids() == [0, 1, 2]
        s.delete([key_of(2)])
        assert s.put(key_of(7), make_kv(7)).chunk_id == 3  # ids never reused
        assert s.key_for_id(1) == key_of(1) and s.meta_for_id(3).key == key_of(7)
        assert same_bits(s.get(key_of(0)).kv, make_kv(0))
        assert s.verify().ok


def test_read_into_rejects_wrong_shape_and_miss_returns_false(store):
    store.put(key_of(0), make_kv(0))
    store.memory_tier.clear()
    with pytest.raises(ValueError, match="stored"):
        store.read_into(key_of(0), torch.empty(2, 2, 9, 2, 4, dtype=torch.bfloat16))
    assert not store.read_into(key_of(5), torch.empty(2, 2, 8, 2, 4, dtype=torch.bfloat16))
    assert store.get(key_of(5)) is None
    assert store.stats().misses == 2


def test_put_rejects_shape_not_matching_fingerprint(store):
    with pytest.raises(ValueError, match="num_kv_heads"):
        store.put(key_of(0), torch.zeros(2, 2, 8, 3, 4))
    with pytest.raises(ValueError, match="token ids"):
        store.put(key_of(0), make_kv(0), token_ids=[1, 2])


def test_chunk_key_is_canonical_and_sensitive(fp):
    k = chunk_key(fp, ANCHOR, [5, 6, 7])
    assert len(k) == 16 and k == chunk_key(fp.digest(), list(ANCHOR), (5, 6, 7))
    assert k != chunk_key(fp, ANCHOR, [5, 6, 8])
    assert k != chunk_key(fp, (1, 5), [6, 7])  # length prefixes keep anchor|chunk apart
    assert k != chunk_key(make_fingerprint(weights_hash="other"), ANCHOR, [5, 6, 7])


def test_fingerprint_serialisation_is_stable(fp):
    again = ModelFingerprint.from_json(fp.to_json())
    assert again == fp and again.digest() == fp.digest()
    same = make_fingerprint(rope={"rope_scaling": None, "rope_theta": 10000.0})
    assert same.digest() == fp.digest()  # dict key order does not matter
    assert fp.diff(make_fingerprint(dtype="float32", num_layers=3)) == ("dtype", "num_layers")


def _sized_store(path, fp, capacity_values: int) -> KVStore:
    value_bytes = 64 + make_kv(0).numel() * 2
    return KVStore(path, fp, max_bytes=capacity_values * value_bytes, memory_tier_bytes=0)


def test_lru_eviction_order_exact(store_path, fp):
    with _sized_store(store_path, fp, 3) as s:
        a, b, c, d, e = (key_of(i) for i in range(5))
        for i, k in enumerate((a, b, c)):
            assert s.put(k, make_kv(i)).evicted == ()
        assert s.get(a) is not None  # a becomes most recently used
        assert s.lru_keys() == [b, c, a]
        assert s.put(d, make_kv(3)).evicted == (1,)  # b (chunk id 1) is the LRU
        assert s.lru_keys() == [c, a, d]
        s.put(a, make_kv(0))  # re-put of a stored key touches it
        assert s.put(e, make_kv(4)).evicted == (2,)  # c
        assert s.lru_keys() == [d, a, e] and b not in s and c not in s
        st = s.stats()
        assert (st.entries, st.evictions) == (3, 2) and st.bytes <= s.max_bytes
        assert s.verify().ok
    with _sized_store(store_path, fp, 3) as s:  # LRU order persists across reopen
        assert s.lru_keys() == [d, a, e]


def test_lru_batch_is_never_evicted_by_itself(store_path, fp):
    with _sized_store(store_path, fp, 3) as s:
        s.put(key_of(0), make_kv(0))
        results = s.put_many([NewChunk(key_of(i), make_kv(i)) for i in (1, 2, 3)])
        assert results[0].evicted == (0,) and len(s) == 3
        with pytest.raises(StoreFullError, match="larger than the store's limit"):
            s.put_many([NewChunk(key_of(i), make_kv(i)) for i in range(10, 14)])
        assert len(s) == 3 and s.verify().ok


def test_map_size_grows_automatically(store_path, fp):
    with KVStore(store_path, fp, map_size=64 << 10) as s:
        kvs = {i: make_kv(i, num_tokens=256) for i in range(40)}  # 8 KiB each
        for i, kv in kvs.items():
            s.put(key_of(i), kv)
        st = s.stats()
        assert st.map_size > 64 << 10 and st.entries == 40
        s.memory_tier.clear()
        assert all(same_bits(s.get(key_of(i)).kv, kv) for i, kv in kvs.items())
        assert s.verify().ok


def test_memory_tier_serves_hot_chunks_and_counts(store_path, fp):
    kv_bytes = make_kv(0).numel() * 2
    with KVStore(store_path, fp, memory_tier_bytes=2 * kv_bytes) as s:
        for i in range(3):
            s.put(key_of(i), make_kv(i))
        for i in (0, 1, 0, 2, 0):
            assert same_bits(s.get(key_of(i)).kv, make_kv(i))
        st = s.stats()
        # tier: 0 miss, 1 miss, 0 hit, 2 miss (evicts 1), 0 hit
        assert (st.memory_hits, st.memory_misses, st.lmdb_hits) == (2, 3, 3)
        assert st.memory_evictions == 1 and st.memory_entries == 2 and st.hits == 5
        assert s.memory_tier.keys() == [key_of(2), key_of(0)]
        s.delete([key_of(0)])
        assert s.get(key_of(0)) is None  # deletion also drops the tier copy


def test_memory_tier_lru_unit():
    tier = MemoryTier(max_bytes=3 * 16)
    t = [torch.zeros(4) for _ in range(4)]  # 16 bytes each
    for i in range(3):
        assert tier.put(bytes([i]), t[i])
    tier.get(b"\x00")
    tier.put(b"\x03", t[3])
    assert tier.keys() == [b"\x02", b"\x00", b"\x03"] and tier.nbytes == 48
    assert not tier.put(b"big", torch.zeros(13))


def test_documents_and_delete(store):
    chunks = [
        NewChunk(key_of(i), make_kv(i), doc_id="a" if i < 3 else "b", position=2 - i % 3)
        for i in range(5)
    ]
    store.put_many(chunks)
    assert [m.position for m in store.document_chunks("a")] == [0, 1, 2]
    assert [m.chunk_id for m in store.document_chunks("b")] == [4, 3]
    assert sorted(store.delete_document("a")) == [0, 1, 2]
    assert store.document_chunks("a") == [] and len(store) == 2
    assert store.stats().bytes == 2 * store.get_meta(key_of(3)).nbytes
    assert store.verify().ok


def test_fill_misses_asks_the_second_source_only_for_the_first_ones_misses():
    from blendkv.store.base import fill_misses

    asked = []

    def second(keys):
        asked.append(keys)
        return [k == b"c" for k in keys]

    keys = [b"a", b"b", b"c"]
    assert fill_misses([True, False, False], keys, second) == [True, False, True]
    assert asked == [[b"b", b"c"]]
    assert fill_misses([True, True, True], keys, second) == [True, True, True]
    assert len(asked) == 1  # nothing missed: not asked at all
