"""``blendkv store`` as a user runs it: a missing store is one line, a closed pipe is quiet,
``compact`` says what it reclaimed."""

from __future__ import annotations

import subprocess
import sys

from store_helpers import key_of, make_kv

from blendkv.store.kv_store import KVStore
from blendkv.store.records import NewChunk

BLENDKV = [sys.executable, "-m", "blendkv.cli"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BLENDKV, *args], capture_output=True, text=True, timeout=120)


def test_stats_of_a_missing_store_is_one_line(tmp_path):
    for action in ("stats", "verify", "compact"):
        done = _run("store", action, "--store", str(tmp_path / "nope"))
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.strip().splitlines() == [
            f"blendkv: error: no blendkv store at {tmp_path / 'nope'}; create one with "
            f"`blendkv ingest PATH --store {tmp_path / 'nope'}`"
        ]


def test_output_into_a_closed_pipe_is_quiet(store_path, fp):
    with KVStore(store_path, fp) as s:  # 3000 document chunks no index lists: 3000 problems
        s.put_many([NewChunk(key_of(i), make_kv(i, 1), doc_id="d") for i in range(3000)])
    cmd = " ".join([*BLENDKV, "store", "verify", "--store", str(store_path)]) + " | head -1"
    done = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith(f"{store_path}: 3000 entries") and done.stdout.count("\n") == 1
    assert done.stderr == ""
    full = _run("store", "verify", "--store", str(store_path))
    assert full.returncode == 1 and len(full.stdout) > 100_000  # more than a pipe holds


def test_stats_and_compact_report_sizes(store_path, fp):
    with KVStore(store_path, fp, max_bytes=1 << 30) as s:
        for i in range(20):
            s.put(key_of(i), make_kv(i, 1024))
        s.delete([key_of(i) for i in range(2, 20)])
    stats = _run("store", "stats", "--store", str(store_path))
    assert "(limit: 1.0 GiB)" in stats.stdout and "on disk" in stats.stdout
    done = _run("store", "compact", "--store", str(store_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"compacted {store_path}: ") and "reclaimed" in done.stdout
