"""Sizes, the projected size of new chunks (equal to what the store then holds), and the checks
that refuse what the limit or the disk cannot hold."""

from __future__ import annotations

import pytest
from store_helpers import key_of, make_kv

from blendkv.sizes import format_size, parse_size
from blendkv.store.capacity import IngestPlan, plan_ingest, projected_bytes
from blendkv.store.errors import StoreFullError
from blendkv.store.kv_store import KVStore
from blendkv.store.records import NewChunk


@pytest.mark.parametrize(
    "text, n",
    [("4096", 4096), ("500M", 500 << 20), ("20G", 20 << 30), ("1.5GiB", 3 << 29), ("2kb", 2048)],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "G", "-1G", "0", "20X", "1 G B"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (512, 2048, 3 << 29)] == ["512 B", "2.0 KiB", "1.5 GiB"]


def test_projection_equals_the_stored_bytes_and_counts_what_may_be_evicted(store_path, fp):
    lengths = [7, 64, 1]
    with KVStore(store_path, fp, max_bytes=1 << 20) as s:
        s.put_many([NewChunk(key_of(i), make_kv(i, n), doc_id="d") for i, n in enumerate(lengths)])
        assert s.stats().bytes == projected_bytes(fp, lengths)
        s.put(key_of(9), make_kv(9, 10))  # no document: evictable
        plan = plan_ingest(s, [100])
        assert plan.num_tokens == 100 and plan.projected == projected_bytes(fp, [100])
        assert plan.evictable == projected_bytes(fp, [10]) and plan.max_bytes == 1 << 20
        assert plan.describe().startswith("projected K/V: 6.3 KiB for 100 tokens (store limit")
        plan.check()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_projection_follows_the_store_codec(tmp_path, fp, codec):
    """An int8 store holds exactly the projection (codes, scales and zeros); an int4 store at
    most it (its outlier heads depend on the values). Both far below the raw size."""
    fp = fp.with_codec(codec)
    lengths = [7, 64, 130]
    with KVStore(tmp_path / codec, fp) as s:
        s.put_many([NewChunk(key_of(i), make_kv(i, n), doc_id="d") for i, n in enumerate(lengths)])
        stored, projected = s.stats().bytes, projected_bytes(fp, lengths)
    assert stored == projected if codec == "int8" else stored <= projected
    assert projected < projected_bytes(fp.with_codec("none"), lengths)


def _plan(**fields) -> IngestPlan:
    base = dict(
        location="s", num_tokens=1, projected=100, max_bytes=None, stored=0, evictable=0, free=None
    )
    return IngestPlan(**{**base, **fields})


def test_checks_refuse_the_limit_and_the_disk():
    _plan(max_bytes=150, stored=80, evictable=40).check()  # 40 held + 100 new <= 150
    with pytest.raises(StoreFullError, match="does not fit its limit"):
        _plan(max_bytes=150, stored=80, evictable=20).check()
    with pytest.raises(StoreFullError, match="free on its disk"):
        _plan(free=105).check()  # 10 % headroom
    _plan(free=111).check()
