"""Opening a store directory: the checks that turn a bad directory into a clear typed error.

Missing directory (``create=False``) -> StoreNotFoundError; a directory the process may not
write -> StoreReadOnlyError (open with ``readonly=True``); not LMDB, LMDB without our
databases, or another store format version -> StoreFormatError; another model ->
FingerprintMismatchError naming the fields that differ.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import lmdb

from . import layout
from .errors import (
    FingerprintMismatchError,
    StoreError,
    StoreFormatError,
    StoreNotFoundError,
    StoreReadOnlyError,
)
from .fingerprint import ModelFingerprint, mismatch_message

_OPEN_PATHS: set[tuple[int, str]] = set()  # (pid, realpath): LMDB forbids double opens
_OPEN_LOCK = threading.Lock()


def dir_writable(path: Path) -> bool:
    # Permission bits are honoured even for root, so a store marked read-only stays so.
    return os.access(path, os.W_OK) and bool(path.stat().st_mode & 0o222)


def check_directory(
    path: Path, *, create: bool, readonly: bool, fingerprint: ModelFingerprint | None
) -> bool:
    """Validate the directory; returns True when a new store must be initialised."""
    if path.exists() and not path.is_dir():
        raise StoreFormatError(f"{path} is a file, not a blendkv store directory")
    has_data = (path / "data.mdb").exists()
    if not has_data:
        if not create or readonly:
            raise StoreNotFoundError(
                f"no blendkv store at {path}; open with create=True (and not readonly)"
            )
        if path.exists() and any(path.iterdir()):
            raise StoreFormatError(f"{path} holds other files but no data.mdb: not a store")
        if fingerprint is None:
            raise StoreError("creating a store needs the model's fingerprint")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except PermissionError as e:
            raise StoreReadOnlyError(f"cannot create {path}: {e}") from e
    if not readonly and not dir_writable(path):
        raise StoreReadOnlyError(f"{path} is not writable; open it with readonly=True")
    return not has_data


def register(path: Path) -> tuple[int, str]:
    key = (os.getpid(), os.path.realpath(path))
    with _OPEN_LOCK:
        if key in _OPEN_PATHS:
            raise StoreError(f"{path} is already open in this process; reuse that store")
        _OPEN_PATHS.add(key)
    return key


def is_open_here(path: Path) -> bool:
    """Whether this process has the store at ``path`` open."""
    with _OPEN_LOCK:
        return (os.getpid(), os.path.realpath(path)) in _OPEN_PATHS


def unregister(key: tuple[int, str]) -> None:
    with _OPEN_LOCK:
        _OPEN_PATHS.discard(key)


def open_env(path: Path, *, readonly: bool, map_size: int, sync: bool) -> lmdb.Environment:
    try:
        return lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=len(layout.DB_NAMES) + 1,
            readonly=readonly,
            lock=True,
            create=not readonly,
            sync=sync,
            meminit=False,  # do not zero page slack: values are written whole
            max_readers=512,
        )
    except (lmdb.ReadonlyError, PermissionError) as e:
        raise StoreReadOnlyError(f"cannot open {path}: {e}") from e
    except lmdb.Error as e:
        raise StoreFormatError(f"{path} is not a readable LMDB store: {e}") from e


def open_dbs(env: lmdb.Environment, path: Path, *, create: bool) -> dict[str, object]:
    dbs = {}
    for name in layout.DB_NAMES:
        try:
            dbs[name] = env.open_db(name.encode(), create=create)
        except lmdb.NotFoundError as e:
            raise StoreFormatError(f"{path} is LMDB but not a blendkv store") from e
        except lmdb.Error as e:
            raise StoreFormatError(f"{path}: cannot open database {name}: {e}") from e
    return dbs


def initialise(txn, dbs: dict, fingerprint: ModelFingerprint) -> None:
    txn.put(b"format", layout.format_record(), db=dbs["store"])
    txn.put(b"fingerprint", fingerprint.to_json().encode(), db=dbs["store"])


def read_max_bytes(txn, dbs: dict) -> int | None:
    """The byte limit saved in the store (by the last open that gave one), or None."""
    raw = txn.get(b"max_bytes", db=dbs["store"])
    return int(bytes(raw)) if raw is not None else None


def write_max_bytes(txn, dbs: dict, max_bytes: int) -> None:
    txn.put(b"max_bytes", str(max_bytes).encode(), db=dbs["store"])


def check_format_and_fingerprint(
    txn, dbs: dict, path: Path, given: ModelFingerprint | None
) -> ModelFingerprint:
    """Returns the stored fingerprint; raises unless format and fingerprint match."""
    raw_format = txn.get(b"format", db=dbs["store"])
    raw_fp = txn.get(b"fingerprint", db=dbs["store"])
    if raw_format is None or raw_fp is None:
        raise StoreFormatError(f"{path} has no blendkv format record")
    try:
        record = json.loads(bytes(raw_format))
        stored = ModelFingerprint.from_json(bytes(raw_fp))
    except (ValueError, TypeError) as e:
        raise StoreFormatError(f"{path}: unreadable format or fingerprint record: {e}") from e
    if not isinstance(record, dict) or record.get("kind") != layout.STORE_KIND:
        raise StoreFormatError(f"{path} is not a blendkv store ({record})")
    if record.get("version") != layout.STORE_FORMAT_VERSION:
        raise StoreFormatError(
            f"{path} has store format version {record.get('version')}; this blendkv reads "
            f"version {layout.STORE_FORMAT_VERSION}: rebuild the store"
        )
    if given is not None and given != stored:
        raise FingerprintMismatchError(mismatch_message(path, given, stored), given.diff(stored))
    return stored
