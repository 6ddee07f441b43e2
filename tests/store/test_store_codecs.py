"""Stores made with a K/V codec: encoded values on LMDB and Redis, the memory tier's encoded
bytes, refusal of another codec's values, verify of encoded values."""

from __future__ import annotations

import pytest
import torch
from store_helpers import key_of, make_fingerprint, same_bits
from test_store_faults import _flip, _raw_edit

from blendkv.store import FingerprintMismatchError, KVStore, open_kv_store
from blendkv.store import format as fmt
from blendkv.store.codecs import EncodedKV, decode_reference, encode
from blendkv.store.errors import CodecMismatchError
from blendkv.store.memory_tier import MemoryTier


def kv_of(seed: int, num_tokens: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, num_tokens, 2, 4), generator=g).to(torch.bfloat16)


def _check_codec_store(store, codec: str) -> None:
    """Put, get (decoded), get_encoded (encoded), read_into: all agree with the codec."""
    kv = kv_of(0)
    store.put(key_of(0), kv)
    want = decode_reference(encode(kv, codec))
    assert same_bits(store.get(key_of(0)).kv, want)
    enc = store.get_encoded(key_of(0), skip_memory_tier=True)
    assert isinstance(enc, EncodedKV) and enc.codec == codec
    assert same_bits(decode_reference(enc), want)
    out = torch.empty_like(kv)
    assert store.read_into(key_of(0), out) and same_bits(out, want)
    assert not same_bits(want, kv)  # the codec really is lossy here: the checks can fail
    with pytest.raises(CodecMismatchError, match="'int4'"):
        store.put(key_of(1), encode(kv_of(1), "int4" if codec != "int4" else "int8"))
    assert store.verify().ok


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_lmdb_store_encodes_with_its_codec(store_path, codec):
    fp = make_fingerprint(kv_codec=codec)
    with KVStore(store_path, fp) as s:
        assert s.kv_codec == codec
        _check_codec_store(s, codec)
        with s.snapshot() as snap:
            view = snap.view_encoded(key_of(0))
            assert isinstance(view, EncodedKV)
            assert same_bits(decode_reference(view), s.get(key_of(0)).kv)
            assert same_bits(snap.view(key_of(0)).kv, s.get(key_of(0)).kv)
    # The codec is the store's: reopening follows it, another one is refused naming both.
    with pytest.raises(FingerprintMismatchError, match=f"codec '{codec}'.*'none'") as e:
        KVStore(store_path, make_fingerprint())
    assert e.value.fields == ("kv_codec",)


def test_redis_store_encodes_with_its_codec(redis_server):
    redis_server.flush()
    fp = make_fingerprint(kv_codec="int8")
    with open_kv_store(redis_server.url, fp, part_bytes=100) as s:
        _check_codec_store(s, "int8")
        assert isinstance(s.get_encoded(key_of(0)), EncodedKV)
    with pytest.raises(FingerprintMismatchError, match="codec 'int8'"):
        open_kv_store(redis_server.url, make_fingerprint(kv_codec="int4"))


def test_the_codec_does_not_change_chunk_keys():
    assert make_fingerprint(kv_codec="int8").digest() == make_fingerprint().digest()
    assert "kv_codec" not in make_fingerprint().to_json()  # stores made before codecs match


def test_a_value_of_another_codec_is_a_corrupt_value(store_path):
    """A value written behind the store's back in another codec is never served."""
    with KVStore(store_path, make_fingerprint(kv_codec="int8")) as s:
        s.put(key_of(0), kv_of(0))
    other = bytes(fmt.encode_value(kv_of(0)))  # codec none
    _raw_edit(store_path, b"values", key_of(0), lambda _: other)
    with KVStore(store_path, make_fingerprint(kv_codec="int8"), readonly=True) as s:
        report = s.verify()
        assert [p.kind for p in report.problems if p.kind == "corrupt_value"] == ["corrupt_value"]
        assert "'none'" in str(report.problems)
        assert s.get(key_of(0)) is None and s.corrupt == 1


@pytest.mark.parametrize("offset", [fmt.HEADER_SIZE + 100, 45, -1], ids=["q", "flags", "end"])
def test_verify_catches_a_flipped_byte_in_an_encoded_value(store_path, offset):
    with KVStore(store_path, make_fingerprint(kv_codec="int4")) as s:
        s.put(key_of(0), kv_of(0))
        s.put(key_of(1), kv_of(1))
        size = s.get_meta(key_of(0)).nbytes
    _raw_edit(store_path, b"values", key_of(0), _flip(offset % size))
    with KVStore(store_path, make_fingerprint(kv_codec="int4"), readonly=True) as s:
        report = s.verify()
        assert [(p.kind, p.subject) for p in report.problems] == [
            ("corrupt_value", key_of(0).hex())
        ]
        assert s.get(key_of(0)) is None and s.get(key_of(1)) is not None


def test_memory_tier_holds_more_encoded_chunks():
    """The same budget holds >= 1.9x (int8) and >= 3.5x (int4, with its outlier heads: random
    keys put one head of 64 over the threshold) the chunks of a raw tier, for a real chunk
    shape (256 tokens, head_dim 64)."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn((8, 2, 256, 8, 64), generator=g).to(torch.bfloat16)
    budget = 40 * kv.numel() * 2  # forty raw chunks
    counts = {}
    for codec in ("none", "int8", "int4"):
        tier = MemoryTier(budget)
        value = encode(kv, codec)
        if codec == "int4":
            assert int(value.outlier_heads.sum()) == 1
        for i in range(200):
            tier.put(i.to_bytes(4, "little"), value)
        assert tier.nbytes <= budget
        counts[codec] = len(tier)
    assert counts["none"] == 40
    assert counts["int8"] >= 1.9 * 40 and counts["int4"] >= 3.5 * 40, counts
