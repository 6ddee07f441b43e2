"""Read snapshots: zero-copy views held open across threads for an engine step."""

from __future__ import annotations

import threading

import pytest
import torch
from store_helpers import key_of, make_kv, same_bits
from test_store_faults import _flip, _raw_edit

from blendkv.store import format as fmt
from blendkv.store.errors import StoreError
from blendkv.store.kv_store import KVStore


def test_views_read_in_another_thread_and_survive_an_eviction(store_path, fp):
    kv0 = make_kv(0, 256)
    with KVStore(store_path, fp, max_bytes=kv0.numel() * 2 * 3 // 2) as s:
        s.put(key_of(0), kv0)
        with s.snapshot() as snap:
            view = snap.view(key_of(0)).kv
            s.put(key_of(1), make_kv(1, 256))  # evicts chunk 0 (least recently used)
            assert key_of(0) not in s
            seen = {}
            reader = threading.Thread(target=lambda: seen.update(kv=view.clone()))
            reader.start()
            reader.join()
            assert same_bits(seen["kv"], kv0)  # the snapshot still holds the old pages
            assert snap.view(key_of(1)) is None  # it sees the state when it was taken
        assert s._snapshots == [] and s.get(key_of(0)) is None
        assert len(s.memory_tier) == 0  # views are never copied into the memory tier
        with pytest.raises(StoreError, match="closed"):
            snap.view(key_of(1))


def test_growing_the_map_waits_for_open_snapshots(store_path, fp):
    small = make_kv(0, 8)
    big = make_kv(1, 40_000)  # 1.3 MB: more than the 1 MB map
    with KVStore(store_path, fp, map_size=1 << 20) as s:
        s.put(key_of(0), small)
        snap = s.snapshot()
        view = snap.view(key_of(0)).kv
        with pytest.raises(StoreError, match="holds a read snapshot"):
            s.put(key_of(1), big)  # the owner would wait for itself
        done = threading.Event()
        writer = threading.Thread(target=lambda: (s.put(key_of(1), big), done.set()))
        writer.start()
        writer.join(timeout=0.5)
        assert not done.is_set()  # still waiting: the map is not remapped under the view
        assert same_bits(view, small)
        snap.close()
        writer.join()
        assert done.is_set() and same_bits(s.get(key_of(1)).kv, big)


def _store_with_a_corrupt_value(store_path, fp) -> None:
    with KVStore(store_path, fp) as s:
        s.put(key_of(0), make_kv(0))
    _raw_edit(store_path, b"values", key_of(0), _flip(fmt.HEADER_SIZE + 5))


def test_a_corrupt_value_seen_through_a_snapshot_is_dropped_when_it_closes(store_path, fp):
    _store_with_a_corrupt_value(store_path, fp)
    with KVStore(store_path, fp) as s:
        with s.snapshot() as snap:
            assert snap.view(key_of(0)) is None
            assert s.stats().corrupt == 1
            assert key_of(0) in s  # not deleted under the open snapshot
        assert key_of(0) not in s


def test_a_good_copy_written_under_the_snapshot_replaces_the_corrupt_value(store_path, fp):
    """A write-back of the chunk (the engine recomputes it) while the snapshot that saw it
    corrupt is open replaces the value, and closing the snapshot keeps the good copy."""
    _store_with_a_corrupt_value(store_path, fp)
    with KVStore(store_path, fp) as s:
        with s.snapshot() as snap:
            assert snap.view(key_of(0)) is None
            writer = threading.Thread(target=s.put, args=(key_of(0), make_kv(0)))
            writer.start()
            writer.join()
        assert key_of(0) in s
        assert same_bits(s.get(key_of(0)).kv, make_kv(0))
        assert s.verify().ok


def test_snapshot_views_follow_verify_reads_and_count_hits(store_path, fp):
    kv = make_kv(3, 16, dtype=torch.float32)
    with KVStore(store_path, fp, verify_reads=True) as s:
        s.put(key_of(3), kv)
        with s.snapshot() as snap:
            assert same_bits(snap.view(key_of(3)).kv, kv)
            assert snap.view(key_of(4)) is None
        stats = s.stats()
        assert (stats.hits, stats.misses, stats.corrupt) == (1, 1, 0)
