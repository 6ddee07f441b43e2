"""``blendkv store stats|verify --store DIR``: inspect a store without loading a model.

``verify`` checks every value, the index against the store, and the document catalog against
the store (:mod:`blendkv.rag.consistency`); it exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import json

from blendkv.commands.ingest import add_store_arg


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


def run(args: argparse.Namespace) -> int:
    from blendkv.rag.catalog import open_catalog
    from blendkv.rag.consistency import check_documents
    from blendkv.store import ChunkStore, MiniLMEmbedder

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
        "model": {"architecture": fp.architecture, "dtype": fp.dtype, "layers": fp.num_layers},
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
    print(
        f"kv bytes   {s.bytes / 2**20:.1f} MiB (limit: {s.max_bytes or 'none'}), "
        f"{s.evictions} evictions"
    )
    return 0
