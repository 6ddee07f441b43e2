"""``compact_store``: the file shrinks to its live data, the data stays bit-identical, and it is
refused while any process has the store open."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from store_helpers import key_of, make_kv, same_bits

from blendkv.store.compact import compact_store
from blendkv.store.errors import StoreError, StoreNotFoundError
from blendkv.store.kv_store import KVStore


def _fill_then_delete(path, fp) -> None:
    with KVStore(path, fp, memory_tier_bytes=0) as s:
        for i in range(40):
            s.put(key_of(i), make_kv(i, 1024), doc_id="d" if i < 4 else None)
        s.delete([key_of(i) for i in range(4, 40)])  # 90 % deleted: the file keeps its size


def test_compact_shrinks_the_file_and_keeps_every_value(store_path, fp):
    _fill_then_delete(store_path, fp)
    result = compact_store(store_path)
    assert result.after < result.before / 4 and result.reclaimed == result.before - result.after
    assert (store_path / "data.mdb").stat().st_size == result.after
    with KVStore(store_path, fp, memory_tier_bytes=0) as s:
        assert s.verify().ok and len(s) == 4
        assert len(s.document_chunks("d")) == 4
        for i in range(4):
            assert same_bits(s.get(key_of(i)).kv, make_kv(i, 1024))
        s.put(key_of(99), make_kv(99, 1024))  # still writable
        assert s.verify().ok


def test_compact_is_refused_while_the_store_is_open(store_path, fp, tmp_path):
    _fill_then_delete(store_path, fp)
    with KVStore(store_path, fp), pytest.raises(StoreError, match="open in this process"):
        compact_store(store_path)
    holder = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from store_helpers import make_fingerprint
        from blendkv.store.kv_store import KVStore
        with KVStore({str(store_path)!r}, make_fingerprint(), readonly=True):
            print("open", flush=True)
            sys.stdin.readline()
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "open"
        before = (store_path / "data.mdb").stat().st_size
        with pytest.raises(StoreError, match="open in another process"):
            compact_store(store_path)
        assert (store_path / "data.mdb").stat().st_size == before
    finally:
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(timeout=60)
    assert compact_store(store_path).reclaimed > 0  # closed: now it compacts


def test_compact_of_a_missing_store(tmp_path):
    with pytest.raises(StoreNotFoundError):
        compact_store(tmp_path / "nothing")
