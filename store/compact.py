"""``compact_store``: give an LMDB store's free pages back to the disk.

LMDB reuses the pages that deleted and evicted chunks free, but never shrinks its file. A
compacting copy (``env.copy(compact=True)``) writes only the live pages; it is verified and then
swapped in with one ``os.replace`` of ``data.mdb``. Every process that has an LMDB environment
open holds a shared lock on the first byte of its ``lock.mdb``; compaction takes that byte
exclusively for its whole run, so it is refused while any process has the store open, and a
process that opens the store meanwhile waits until the swap is done.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import lmdb

from . import layout
from .errors import StoreError, StoreNotFoundError
from .kv_store import KVStore
from .opening import is_open_here


class CompactResult(NamedTuple):
    before: int  # bytes of data.mdb on disk before
    after: int  # and after

    @property
    def reclaimed(self) -> int:
        return self.before - self.after


def compact_store(path: str | os.PathLike) -> CompactResult:
    """Compact the LMDB store at ``path`` in place; raises :class:`StoreError` while another
    process (or this one) has it open, and leaves the store as it was on any failure."""
    path = Path(path)
    data = path / "data.mdb"
    if not data.exists():
        raise StoreNotFoundError(f"no blendkv store at {path}")
    if is_open_here(path):
        raise StoreError(f"{path} is open in this process; close it before compacting")
    with open(path / "lock.mdb", "a+b") as lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        except OSError as e:
            raise StoreError(
                f"{path} is open in another process (a server, an ingest, ...); stop it and "
                "compact again"
            ) from e
        before = data.stat().st_size
        tmp = Path(tempfile.mkdtemp(prefix=".compact-", dir=path.parent))
        try:
            # No LMDB locks of our own: closing them would drop the exclusive lock above.
            env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=len(layout.DB_NAMES) + 1)
            try:
                want = _entries_and_bytes(env)
                env.copy(str(tmp), compact=True)
            finally:
                env.close()
            _check_copy(path, tmp, want)
            os.replace(tmp / "data.mdb", data)
        except lmdb.Error as e:
            raise StoreError(f"compacting {path} failed (the store is unchanged): {e}") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return CompactResult(before, data.stat().st_size)


def _entries_and_bytes(env: lmdb.Environment) -> tuple[int, int]:
    with env.begin() as txn:
        store = env.open_db(b"store", txn=txn, create=False)
        chunks = env.open_db(b"chunks", txn=txn, create=False)
        return txn.stat(chunks)["entries"], layout.Counters.read(txn, store).total_bytes


def _check_copy(path: Path, copy: Path, want: tuple[int, int]) -> None:
    """The copy must hold exactly the original's entries and bytes, every value intact (opened
    with its own lock file: one on the original's would end this process's exclusive lock)."""
    with KVStore(copy, None, readonly=True, memory_tier_bytes=0) as compacted:
        report = compacted.verify()
    if not report.ok or (report.entries, report.bytes) != want:
        raise StoreError(f"the compacted copy of {path} did not verify: {report}")
