"""``blendkv docs list|show|delete --store DIR``: the documents of a store, without a model.

``list`` prints every catalogued document (id, chunks, when added, source); ``show ID|SOURCE``
its catalog entry and the start of each chunk's text; ``delete ID|SOURCE...`` removes documents
from store, index and catalog, keeping the chunks another document uses
(:mod:`blendkv.rag.deletion`). A source names every document ingested from it. The store opens
in inspect mode (no fingerprint, no model): only metadata, the index file and the catalog are
read or written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from blendkv.commands.ingest import add_store_arg

_PREVIEW = 100  # characters of each chunk's text that `docs show` prints


def register(sub) -> None:
    p = sub.add_parser("docs", help="list, show or delete a store's documents (no model)")
    action = p.add_subparsers(dest="action", required=True)
    a = action.add_parser("list", help="every document: id, chunks, added, source")
    add_store_arg(a)
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=run)
    a = action.add_parser("show", help="one document's entry and the start of its chunks")
    a.add_argument("ref", metavar="ID|SOURCE", help="a doc id, or the source it came from")
    add_store_arg(a)
    a.add_argument("--full", action="store_true", help="print each chunk's whole text")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=run)
    a = action.add_parser(
        "delete", help="remove documents (their chunks no other document uses, too)"
    )
    a.add_argument("refs", nargs="+", metavar="ID|SOURCE", help="doc ids or sources")
    add_store_arg(a)
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blendkv.rag.catalog import open_catalog
    from blendkv.rag.chunk_store import ChunkStore
    from blendkv.rag.embedding import MiniLMEmbedder
    from blendkv.store import StoreNotFoundError
    from blendkv.store.redis_store import is_redis_url

    if not is_redis_url(args.store) and not (Path(args.store) / "data.mdb").exists():
        raise StoreNotFoundError(
            f"no blendkv store at {args.store}; create one with `blendkv ingest PATH --store DIR`"
        )
    # fingerprint=None: inspect mode; the embedder is only named (weights load on first
    # embed, which nothing here does).
    readonly = args.action != "delete"
    with ChunkStore(args.store, None, MiniLMEmbedder(), readonly=readonly) as store:
        catalog = open_catalog(args.store, store.kv)
        lines, record = _ACTIONS[args.action](args, store, catalog)
    return _emit(record if args.json else lines)


def _list(args, store, catalog) -> tuple[list[str], dict]:
    from blendkv.rag.listing import sorted_documents

    docs = sorted_documents(catalog)
    lines = [
        f"{e['doc_id']}  {e['num_chunks']:5d} chunks  {_when(e['added'])}  {e['source'] or '-'}"
        for e in docs
    ]
    lines.append(f"{len(docs)} document(s) in {args.store}")
    return lines, {"store": str(args.store), "documents": docs}


def _show(args, store, catalog) -> tuple[list[str], dict]:
    from blendkv.rag.listing import document_chunks, document_entry, resolve_documents

    lines: list[str] = []
    shown = []
    for doc_id in resolve_documents(catalog, store.kv, [args.ref]):
        entry = document_entry(doc_id, catalog.get(doc_id))
        chunks = document_chunks(store.kv, catalog, doc_id)
        stored = sum(c["chunk_id"] is not None for c in chunks)
        if lines:
            lines.append("")
        lines += [
            f"doc_id    {doc_id}",
            f"source    {entry['source'] or '-'}",
            f"added     {_when(entry['added'])}",
            f"metadata  {json.dumps(entry['metadata'], ensure_ascii=False)}",
            f"chunks    {len(chunks)} ({stored} stored)",
        ]
        for c in chunks:
            text = c["text"] if args.full else " ".join(c["text"].split())[:_PREVIEW]
            where = f"chunk {c['chunk_id']}" if c["chunk_id"] is not None else "not stored"
            lines.append(f"  [{c['position']}] {where}, {c['num_tokens']} tokens: {text}")
        shown.append({**entry, "chunks": chunks})
    return lines, {"store": str(args.store), "documents": shown}


def _delete(args, store, catalog) -> tuple[list[str], dict]:
    from blendkv.rag.deletion import delete_document
    from blendkv.rag.listing import resolve_documents

    # all checked before anything is deleted
    doc_ids = resolve_documents(catalog, store.kv, args.refs)
    done = [delete_document(store, catalog, d) for d in doc_ids]
    lines = [
        f"deleted {d.doc_id} ({d.source or 'no source'}): {d.removed} chunk(s) removed"
        + (f", {d.kept} kept (used by other documents)" if d.kept else "")
        for d in done
    ]
    record = {
        "store": str(args.store),
        "deleted": [
            {"doc_id": d.doc_id, "source": d.source, "removed": d.removed, "kept": d.kept}
            for d in done
        ],
    }
    return lines, record


_ACTIONS = {"list": _list, "show": _show, "delete": _delete}


def _when(added: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(added)) if added else "-"


def _emit(out: list[str] | dict) -> int:
    """Print lines or one JSON object; a reader that stops early (``| head``) ends it quietly."""
    text = json.dumps(out, ensure_ascii=False) if isinstance(out, dict) else "\n".join(out)
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would report the pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
