"""Sizes, the projected size of new chunks (equal to what the store then holds), the checks
that refuse what the limit or the disk cannot hold, and the limit as a bound on the store's
file on disk (``data.mdb``), measured."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch
from store_helpers import key_of, make_fingerprint, make_kv

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
        assert plan.file_bytes == 1 << 20 and plan.in_file == 2 * 4096  # whole pages
        assert plan.reserve == 64 * 4096  # free pages the store keeps in its file
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
    # a bounded LMDB store: the values in whole pages and the free pages it keeps, in its file
    _plan(max_bytes=150, file_bytes=300, in_file=200, reserve=60, stored=40).check()
    with pytest.raises(StoreFullError, match="on disk"):
        _plan(max_bytes=150, file_bytes=300, in_file=201, reserve=60, stored=40).check()


# ------------------------------------------------------------------ the bound is the file's
WIDE = make_fingerprint(dtype="float32", num_kv_heads=4, head_dim=64)  # 4 KiB of K/V per token


def _wide_kv(num_tokens: int) -> torch.Tensor:
    return torch.randn(2, 2, num_tokens, 4, 64)


def _data_mdb(path) -> int:
    return os.path.getsize(os.path.join(path, "data.mdb"))


def test_the_file_stays_within_the_bound_while_a_snapshot_is_open_in_another_thread(tmp_path):
    """Values of 4 KiB to 1.2 MiB, five times the bound in all, with engine-step snapshots
    opened and closed by another thread meanwhile (they keep pages from being reused)."""
    bound = 6 << 20
    rng = random.Random(0)
    stop = threading.Event()
    sizes, held = [], []
    with KVStore(tmp_path / "s", WIDE, max_bytes=bound, memory_tier_bytes=0, sync=False) as s:

        def steps() -> None:
            while not stop.is_set():
                snapshot = s.snapshot()
                time.sleep(0.002)
                snapshot.close()

        stepper = threading.Thread(target=steps)
        stepper.start()
        try:
            written = i = 0
            while written < 5 * bound:
                kv = _wide_kv(rng.choice([1, 8, 30, 60, 120, 300]))
                s.put(key_of(i), kv, text=f"chunk {i}")
                written, i = written + kv.numel() * 4, i + 1
                sizes.append(_data_mdb(s.path))
                held.append(s.stats().bytes)
        finally:
            stop.set()
            stepper.join()
        assert s.stats().evictions > 0 and s.verify().ok
        map_size = s.stats().map_size
    assert max(sizes) <= bound  # the file, not only its values
    assert map_size == bound
    assert sum(held[-20:]) / 20 >= 0.6 * bound  # and the bound is used, not left empty
    with KVStore(tmp_path / "s", WIDE) as s:  # the bound is saved with the store
        assert s.max_bytes == bound
        s.put(key_of(10**6), _wide_kv(300))
        assert _data_mdb(s.path) <= bound


def test_documents_that_fill_the_file_are_refused_and_nothing_is_half_written(tmp_path):
    bound = 2 << 20
    with KVStore(tmp_path / "s", WIDE, max_bytes=bound, memory_tier_bytes=0) as s:
        stored = 0
        with pytest.raises(StoreFullError, match="full"):
            for i in range(100):  # 400 KiB each, owned by a document: never evicted
                s.put(key_of(i), _wide_kv(100), doc_id="d", position=i)
                stored += 1
        assert 0 < stored < 5 and len(s) == stored and s.verify().ok
        assert _data_mdb(s.path) <= bound
        s.put(key_of(1000), _wide_kv(1))  # a small chunk still fits in the pages left


def test_a_lowered_bound_stops_the_file_growing(tmp_path):
    with KVStore(tmp_path / "s", WIDE, max_bytes=8 << 20, sync=False) as s:
        for i in range(12):
            s.put(key_of(i), _wide_kv(100))
        before = _data_mdb(s.path)
        s.max_bytes = 2 << 20  # below the file: it cannot shrink, and grows no more than
        for i in range(12, 40):  # the free pages an eviction needs (64 pages at most)
            s.put(key_of(i), _wide_kv(100))
            assert _data_mdb(s.path) <= before + 64 * 4096
        assert s.stats().bytes <= 2 << 20 and len(s) >= 2
        assert s.verify().ok


def test_a_value_the_file_cannot_hold_is_refused_before_anything_is_evicted(tmp_path):
    bound = 2 << 20
    with KVStore(tmp_path / "s", WIDE, max_bytes=bound, memory_tier_bytes=0) as s:
        s.put(key_of(0), _wide_kv(100))
        big = _wide_kv(470)  # 1.9 MB: within the bound, not beside the pages the file keeps free
        assert big.numel() * 4 < bound
        with pytest.raises(StoreFullError, match="larger than the store's limit"):
            s.put(key_of(1), big)
        assert len(s) == 1 and s.stats().evictions == 0
