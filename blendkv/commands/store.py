"""``blendkv store stats|verify|compact --store DIR``, ``blendkv store convert SRC DST
--codec C``: inspect, compact or re-encode a store without loading a model.

``verify`` checks every value, the index against the store, and the document catalog against
the store (:mod:`blendkv.rag.consistency`); it exits 1 on any problem. ``compact`` gives the
pages of deleted and evicted chunks back to the disk (:mod:`blendkv.store.compact`).
``convert`` writes a new store with another K/V codec (:mod:`blendkv.rag.store_convert`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from blendkv.commands.ingest import add_store_arg
from blendkv.sizes import format_size


def register(sub) -> None:
    p = sub.add_parser("store", help="inspect a chunk-KV store (no model is loaded)")
    action = p.add_subparsers(dest="action", required=True)
    for name, help_ in (
        ("stats", "entries, bytes, documents"),
        ("verify", "check every value, the index and the document catalog"),
    ):
        a = action.add_parser(name, help=help_)
        add_store_arg(a)
        a.add_argument("--json", action="store_true", help="print one JSON object")
        a.set_defaults(func=run)
    a = action.add_parser(
        "compact", help="give the disk space of deleted and evicted chunks back (LMDB)"
    )
    add_store_arg(a)
    a.set_defaults(func=run_compact)
    a = action.add_parser(
        "convert", help="write a copy of a store with another K/V codec, then verify it"
    )
    a.add_argument("src", metavar="SRC", help="the store to read: LMDB directory or redis:// URL")
    a.add_argument("dst", metavar="DST", help="the new store: LMDB directory or redis:// URL")
    a.add_argument(
        "--codec", required=True, choices=["none", "int8", "int4"], help="DST's K/V codec"
    )
    a.add_argument("--no-progress", action="store_true", help="no progress bar")
    a.set_defaults(func=run_convert)


def run(args: argparse.Namespace) -> int:
    if not _exists(args.store):
        return 2  # a usage error, as `ask` on a missing store
    from blendkv.rag.catalog import open_catalog
    from blendkv.rag.chunk_store import ChunkStore
    from blendkv.rag.consistency import check_documents
    from blendkv.rag.embedding import MiniLMEmbedder

    # fingerprint=None: inspect mode (metadata and checks, no K/V served); the embedder is
    # only named (its weights load on first embed, which inspection never does).
    with ChunkStore(args.store, None, MiniLMEmbedder(), readonly=True) as store:
        catalog = open_catalog(args.store, store.kv)
        if args.action == "stats":
            return _stats(args, store, catalog)
        report = store.verify()
        check_documents(catalog, store.kv, report)
        if args.json:
            problems = [p._asdict() for p in report.problems]
            print(json.dumps({"ok": report.ok, "entries": report.entries, "problems": problems}))
        else:
            print(f"{args.store}: {report}")
        return 0 if report.ok else 1


def _stats(args, store, catalog) -> int:
    s = store.kv.stats()
    fp = store.kv.fingerprint
    record = {
        "store": str(args.store),
        "chunks": s.entries,
        "indexed_chunks": len(store.index),
        "documents": len(catalog.documents()),
        "stored_documents": len({m.doc_id for m in store.kv.iter_meta() if m.doc_id is not None}),
        "kv_bytes": s.bytes,
        "max_bytes": s.max_bytes,
        "evictions": s.evictions,
        "map_used_bytes": s.map_used,
        "disk_bytes": None if store.shared else (Path(args.store) / "data.mdb").stat().st_size,
        "model": {"architecture": fp.architecture, "dtype": fp.dtype, "layers": fp.num_layers},
        "kv_codec": fp.kv_codec,
        "bytes_per_token": _bytes_per_token(store.kv, s.bytes),
        "embedder": store.index.embedder_name,
    }
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"store      {record['store']}")
    print(f"model      {fp.architecture} ({fp.dtype}, {fp.num_layers} layers)")
    stored = record["stored_documents"]
    note = f" ({stored} own stored chunks; see `blendkv store verify`)"
    print(f"documents  {record['documents']}{note if stored != record['documents'] else ''}")
    print(f"chunks     {s.entries} stored, {record['indexed_chunks']} indexed")
    limit = format_size(s.max_bytes) if s.max_bytes else "none"
    print(f"kv bytes   {format_size(s.bytes)} (limit: {limit}), {s.evictions} evictions")
    per_token = record["bytes_per_token"]
    print(f"kv codec   {fp.kv_codec}, {per_token or 0:.0f} bytes per token")
    if record["disk_bytes"] is not None:
        on_disk = format_size(record["disk_bytes"])
        print(f"on disk    {on_disk} (`blendkv store compact` gives unused pages back)")
    return 0


def _bytes_per_token(kv, total_bytes: int) -> float | None:
    """Stored value bytes per chunk token (header included); None for an empty store."""
    tokens = sum(m.num_tokens for m in kv.iter_meta())
    return total_bytes / tokens if tokens else None


def run_convert(args: argparse.Namespace) -> int:
    if not _exists(args.src):
        return 2
    from tqdm import tqdm

    from blendkv.rag.store_convert import convert_store

    with tqdm(desc="convert", unit="chunk", disable=args.no_progress) as bar:
        result = convert_store(args.src, args.dst, args.codec, progress=bar.update)
    print(
        f"converted {args.src} ({result.src_codec}, {format_size(result.src_bytes)}) -> "
        f"{args.dst} ({result.dst_codec}, {format_size(result.dst_bytes)}): {result.chunks} "
        f"chunks, {result.src_bytes / max(result.dst_bytes, 1):.2f}x smaller"
    )
    print(f"{args.dst}: {result.report}")
    return 0 if result.report.ok else 1


def run_compact(args: argparse.Namespace) -> int:
    from blendkv.store.compact import compact_store

    if _is_redis(args.store):
        print(f"{args.store}: nothing to compact (a Redis server manages its own memory)")
        return 0
    if not _exists(args.store):
        return 2  # a usage error, as `ask` on a missing store
    result = compact_store(args.store)
    print(
        f"compacted {args.store}: {format_size(result.before)} -> {format_size(result.after)} "
        f"on disk ({format_size(result.reclaimed)} reclaimed)"
    )
    return 0


def _exists(store: str) -> bool:
    """An LMDB store directory holds data.mdb; if not, say so in one line (a Redis store is
    checked when it is opened)."""
    if _is_redis(store) or (Path(store) / "data.mdb").exists():
        return True
    print(
        f"blendkv: error: no blendkv store at {store}; create one with "
        f"`blendkv ingest PATH --store {store}`",
        file=sys.stderr,
    )
    return False


def _is_redis(location: str) -> bool:
    # store.redis_store.is_redis_url, without importing the store (and torch) to parse flags
    return location.startswith(("redis://", "rediss://", "unix://"))
