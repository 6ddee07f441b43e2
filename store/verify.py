"""Full consistency check of a store: every value's header, checksum and codec (an encoded
value's sections are decoded as far as their layout: sizes, outlier-head mask), and the
agreement of values, metadata, id map, LRU and document index, and of the byte counter."""

from __future__ import annotations

import json

from . import format as fmt
from .errors import CorruptValueError
from .layout import Counters, be64, doc_entry, from_be64, unpack_usage
from .records import VerifyReport


def verify_txn(txn, dbs: dict, report: VerifyReport, codec: str | None = None) -> dict[int, bytes]:
    """Check everything visible in read transaction ``txn`` (values of another ``codec`` than
    the store's are problems); returns ``{chunk_id: key}``."""
    counters = Counters.read(txn, dbs["store"])
    value_sizes = _check_values(txn, dbs, report, codec)
    ids, lru_seqs = _check_chunks(txn, dbs, report, counters, value_sizes)
    _check_orphans(txn, dbs, report, ids, value_sizes, lru_seqs)
    total = sum(value_sizes.values())
    if total != counters.total_bytes:
        report.add("bytes_counter", "store", f"counter {counters.total_bytes} != sum {total}")
    report.entries = len(ids)
    report.bytes = total
    return ids


def _check_values(txn, dbs: dict, report: VerifyReport, codec: str | None) -> dict[bytes, int]:
    """Decode every value (header, checksum, codec); returns ``{key: value size in bytes}``."""
    value_sizes: dict[bytes, int] = {}
    for key, value in txn.cursor(db=dbs["values"]):
        key = bytes(key)
        value_sizes[key] = len(value)
        try:
            header = fmt.check_value(value, codec=codec)
            fmt.decode_value(value, header)
        except CorruptValueError as e:
            report.add("corrupt_value", key.hex(), str(e))
    return value_sizes


def _check_chunks(
    txn, dbs: dict, report: VerifyReport, counters: Counters, value_sizes: dict[bytes, int]
) -> tuple[dict[int, bytes], dict[bytes, int]]:
    """Check every chunk's metadata against its value, the id counter, the id map, its LRU
    usage record and the document index; returns ``({chunk_id: key}, {key: LRU seq})``."""
    ids: dict[int, bytes] = {}
    lru_seqs: dict[bytes, int] = {}
    for key, raw in txn.cursor(db=dbs["chunks"]):
        key = bytes(key)
        try:
            meta = json.loads(bytes(raw))
            cid = int(meta["chunk_id"])
        except (ValueError, KeyError, TypeError) as e:
            report.add("bad_metadata", key.hex(), f"unreadable JSON: {e}")
            continue
        ids[cid] = key
        if key not in value_sizes:
            report.add("missing_value", key.hex(), f"metadata of chunk {cid} has no value")
        elif meta.get("nbytes") != value_sizes[key]:
            report.add("bytes_mismatch", key.hex(), f"meta {meta.get('nbytes')} != value")
        if cid >= counters.next_chunk_id:
            report.add("id_counter", cid, f"id >= next_chunk_id {counters.next_chunk_id}")
        mapped = txn.get(be64(cid), db=dbs["ids"])
        if mapped is None or bytes(mapped) != key:
            report.add("id_mismatch", cid, "ids database does not map this id to its key")
        usage = txn.get(key, db=dbs["usage"])
        if usage is None:
            report.add("missing_usage", key.hex(), "no LRU usage record")
        else:
            lru_seqs[key] = unpack_usage(usage)[0]
        doc_id = meta.get("doc_id")
        if doc_id is not None and txn.get(doc_entry(doc_id, cid), db=dbs["docs"]) is None:
            report.add("missing_doc_entry", cid, f"document {doc_id!r} does not list it")
    return ids, lru_seqs


def _check_orphans(
    txn,
    dbs: dict,
    report: VerifyReport,
    ids: dict[int, bytes],
    value_sizes: dict[bytes, int],
    lru_seqs: dict[bytes, int],
) -> None:
    """Find values, ids, LRU entries and document entries that no chunk's metadata names, and
    an LRU of another size than the chunks."""
    for key in value_sizes.keys() - set(ids.values()):
        report.add("orphan_value", key.hex(), "value without metadata")
    for raw_id, key in txn.cursor(db=dbs["ids"]):
        cid = from_be64(raw_id)
        if ids.get(cid) != bytes(key):
            report.add("orphan_id", cid, "id maps to a key without matching metadata")
    lru_count = 0
    for raw_seq, key in txn.cursor(db=dbs["lru"]):
        lru_count += 1
        if lru_seqs.get(bytes(key)) != from_be64(raw_seq):
            report.add("orphan_lru", from_be64(raw_seq), "LRU entry does not match usage")
    if lru_count != len(ids):
        report.add("lru_count", "lru", f"{lru_count} LRU entries for {len(ids)} chunks")
    for entry, key in txn.cursor(db=dbs["docs"]):
        cid = from_be64(bytes(entry)[-8:])
        if ids.get(cid) != bytes(key):
            report.add("orphan_doc_entry", cid, "document index names a missing chunk")
