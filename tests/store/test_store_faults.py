"""Bad input and faults: corruption, wrong model, bad directories, concurrent readers, SIGKILL."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
import torch
from store_helpers import NUM_CONCURRENT, key_of, make_fingerprint, make_kv, reader_main, same_bits

from blendkv.errors import BlendKVError
from blendkv.store import format as fmt
from blendkv.store.errors import (
    FingerprintMismatchError,
    StoreError,
    StoreFormatError,
    StoreNotFoundError,
    StoreReadOnlyError,
)
from blendkv.store.kv_store import KVStore
from blendkv.store.records import NewChunk


def _raw_edit(path: Path, db: bytes, key: bytes, edit) -> None:
    """Rewrite one LMDB value behind the store's back."""
    env = lmdb.open(str(path), max_dbs=10)
    handle = env.open_db(db, create=False)
    with env.begin(write=True, db=handle) as txn:
        txn.put(key, edit(bytearray(txn.get(key))))
    env.close()


def _flip(offset: int):
    def edit(value: bytearray) -> bytes:
        value[offset] ^= 0x01
        return bytes(value)

    return edit


@pytest.mark.parametrize(
    "offset", [fmt.HEADER_SIZE + 37, 0, 9, 30], ids=["payload", "magic", "checksum", "shape"]
)
def test_corrupt_value_is_a_miss_never_served(store_path, fp, caplog, offset):
    with KVStore(store_path, fp) as s:
        s.put(key_of(0), make_kv(0))
        s.put(key_of(1), make_kv(1))
    _raw_edit(store_path, b"values", key_of(0), _flip(offset))
    with KVStore(store_path, fp) as s:
        report = s.verify()
        assert [(p.kind, p.subject) for p in report.problems] == [
            ("corrupt_value", key_of(0).hex())
        ]
        with caplog.at_level(logging.WARNING, logger="blendkv.store"):
            assert s.get(key_of(0)) is None
        assert "corrupt value" in caplog.text
        assert s.stats().corrupt == 1 and s.stats().misses == 1
        assert same_bits(s.get(key_of(1)).kv, make_kv(1))
        # the bad entry was dropped, so a write-back stores a good copy again
        assert s.verify().ok and key_of(0) not in s
        s.put(key_of(0), make_kv(0))
        assert same_bits(s.get(key_of(0)).kv, make_kv(0))


def test_corrupt_byte_in_data_file_detected_by_read_into(store_path, fp):
    kv = torch.arange(2 * 2 * 64 * 2 * 4, dtype=torch.float32).view(2, 2, 64, 2, 4)
    with KVStore(store_path, fp) as s:
        s.put(key_of(0), kv)
    data = bytearray((store_path / "data.mdb").read_bytes())
    marker = kv.view(-1)[100:108].numpy().tobytes()
    at = data.find(marker)
    assert at > 0
    while at >= 0:  # copy-on-write may leave a stale copy in a free page: flip every copy
        data[at + 3] ^= 0x40
        at = data.find(marker, at + 1)
    (store_path / "data.mdb").write_bytes(bytes(data))
    with KVStore(store_path, fp, readonly=True) as s:  # read-only: reported, not dropped
        out = torch.empty_like(kv)
        assert not s.read_into(key_of(0), out)
        assert s.get(key_of(0)) is None and s.stats().corrupt == 2
        assert [p.kind for p in s.verify().problems] == ["corrupt_value"]


def test_fingerprint_mismatch_names_fields(store_path, fp):
    KVStore(store_path, fp).close()
    other = make_fingerprint(weights_hash="different", head_dim=8, rope={"rope_theta": 5e5})
    with pytest.raises(FingerprintMismatchError) as err:
        KVStore(store_path, other)
    assert err.value.fields == ("weights_hash", "rope", "head_dim")
    assert "weights_hash" in str(err.value) and "head_dim: store=4 given=8" in str(err.value)
    assert isinstance(err.value, BlendKVError)
    with KVStore(store_path, fp) as s:  # the refused open left nothing locked or registered
        s.put(key_of(0), make_kv(0))


def test_inspect_mode_reads_stats_but_serves_no_kv(store_path, fp):
    with KVStore(store_path, fp) as s:
        s.put(key_of(0), make_kv(0), text="x")
    with KVStore(store_path, readonly=True) as s:
        assert s.fingerprint == fp and s.stats().entries == 1 and s.verify().ok
        assert s.get_meta(key_of(0)).text == "x"
        with pytest.raises(StoreError, match="inspect"):
            s.get(key_of(0))


def test_missing_directory(tmp_path, fp):
    with pytest.raises(StoreNotFoundError):
        KVStore(tmp_path / "nope", fp, create=False)
    with pytest.raises(StoreNotFoundError):
        KVStore(tmp_path / "nope", fp, readonly=True)
    assert not (tmp_path / "nope").exists()


def test_read_only_directory(store_path, fp):
    with KVStore(store_path, fp) as s:
        s.put(key_of(0), make_kv(0))
    os.chmod(store_path, 0o555)
    try:
        with pytest.raises(StoreReadOnlyError, match="readonly=True"):
            KVStore(store_path, fp)
        with KVStore(store_path, fp, readonly=True) as s:
            assert same_bits(s.get(key_of(0)).kv, make_kv(0))
            with pytest.raises(StoreReadOnlyError):
                s.put(key_of(1), make_kv(1))
    finally:
        os.chmod(store_path, 0o755)


def test_wrong_format_version(store_path, fp):
    KVStore(store_path, fp).close()
    _raw_edit(store_path, b"store", b"format", lambda v: b'{"kind":"blendkv.store","version":99}')
    with pytest.raises(StoreFormatError, match="version 99"):
        KVStore(store_path, fp)


def test_not_a_blendkv_store(tmp_path, fp):
    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign))
    with env.begin(write=True) as txn:
        txn.put(b"a", b"b")
    env.close()
    with pytest.raises(StoreFormatError, match="not a blendkv store"):
        KVStore(foreign, fp)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "data.mdb").write_bytes(os.urandom(20000))
    with pytest.raises(StoreFormatError):
        KVStore(garbage, fp)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hi")
    with pytest.raises(StoreFormatError, match="no data.mdb"):
        KVStore(other, fp)
    with pytest.raises(StoreFormatError, match="is a file"):
        KVStore(other / "notes.txt", fp)


def test_same_store_twice_in_one_process_refused(store):
    with pytest.raises(StoreError, match="already open"):
        KVStore(store.path, store.fingerprint)


def test_concurrent_readers_see_none_or_exact(store_path, fp):
    KVStore(store_path, fp, map_size=64 << 10).close()
    ctx = mp.get_context("spawn")
    results, ready = ctx.Queue(), ctx.Queue()
    stop_at = time.time() + 40
    readers = [
        ctx.Process(target=reader_main, args=(str(store_path), ro, stop_at, ready, results))
        for ro in (True, False)
    ]
    for r in readers:
        r.start()
    # tiny map: the writer grows it while the readers read (they must adopt the new size)
    with KVStore(store_path, fp, map_size=64 << 10) as s:
        for _ in readers:  # start writing only once every reader reads
            ready.get(timeout=60)
        for i in range(NUM_CONCURRENT):
            s.put(key_of(i), make_kv(i, 512))
            time.sleep(0.01)
        outcomes = [results.get(timeout=60) for _ in readers]
        assert s.verify().ok
    for r in readers:
        r.join(timeout=30)
        assert r.exitcode == 0
    assert all(bad == 0 for _, _, bad in outcomes), outcomes
    assert all(seen > 0 and none > 0 for seen, none, _ in outcomes), outcomes


@pytest.mark.parametrize("kill_after_batches", [1, 4])
def test_writer_killed_mid_batch_leaves_clean_store(store_path, fp, kill_after_batches):
    helper = Path(__file__).with_name("store_helpers.py")
    batch, num_tokens = 4, 8192  # 1 MiB bf16 per chunk: most time is spent inside txns
    proc = subprocess.Popen(
        [sys.executable, str(helper), str(store_path), "1000", str(batch), str(num_tokens)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(kill_after_batches):
            assert proc.stdout.readline().startswith("committed")
        time.sleep(0.03)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with KVStore(store_path, fp) as s:
        report = s.verify()
        assert report.ok, str(report)
        n = len(s)
        assert n >= kill_after_batches * batch and n % batch == 0  # batches are atomic
        s.memory_tier.clear()
        for i in range(n):
            assert same_bits(s.get(key_of(i)).kv, make_kv(i, num_tokens))
        assert s.get(key_of(n)) is None
        s.put_many([NewChunk(key_of(n), make_kv(n, num_tokens))])  # still writable
        assert s.verify().ok
