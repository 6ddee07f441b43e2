"""A store's documents as people and clients read them: entries, chunks, sizes, pages.

``blendkv docs list|show`` and the server's ``/v1/blendkv/documents`` routes share these. A page
reads only its own documents' chunk metadata, so listing a store of a million chunks costs what
its page holds (the catalog itself is one small record per document).
"""

from __future__ import annotations

from typing import Any

from blendkv.rag.errors import UnknownDocumentError

MAX_PAGE = 500  # documents one page may hold


def resolve_documents(catalog, kv, refs: list[str]) -> list[str]:
    """The doc ids the refs name (catalogued, or stored by an interrupted ingest), in order;
    a ref that names none raises before anything happens."""
    out: list[str] = []
    for ref in refs:
        found = catalog.find(ref) or ([ref] if kv.document_chunks(ref) else [])
        if not found:
            raise UnknownDocumentError(
                f"no document {ref!r} in the store (neither a doc id nor a source); "
                "`blendkv docs list --store ...` shows them"
            )
        out += [d for d in found if d not in out]
    return out


def document_entry(doc_id: str, entry: dict) -> dict[str, Any]:
    """``{"doc_id", "source", "num_chunks", "added", "metadata"}`` of a catalog entry."""
    return {
        "doc_id": doc_id,
        "source": entry.get("source"),
        "num_chunks": entry.get("num_chunks", 0),
        "added": entry.get("added"),
        "metadata": entry.get("metadata", {}),
    }


def chunk_metas(kv, catalog, doc_id: str) -> list:
    """The document's chunk metadata in order (None for a listed chunk no longer stored): the
    keys its entry lists (a chunk another document stored first included), or the chunks it
    owns when the entry lists none."""
    keys = catalog.chunk_keys(doc_id)
    return [kv.get_meta(k) for k in keys] if keys is not None else kv.document_chunks(doc_id)


def document_chunks(kv, catalog, doc_id: str) -> list[dict[str, Any]]:
    """``{"position", "chunk_id", "num_tokens", "nbytes", "text"}`` of each chunk, in order."""
    return [
        {
            "position": pos,
            "chunk_id": m.chunk_id if m is not None else None,
            "num_tokens": m.num_tokens if m is not None else None,
            "nbytes": m.nbytes if m is not None else None,
            "text": m.text if m is not None else "",
        }
        for pos, m in enumerate(chunk_metas(kv, catalog, doc_id))
    ]


def sorted_documents(catalog) -> list[dict[str, Any]]:
    """Every catalogued document's entry, oldest first (then by doc id)."""
    docs = [document_entry(d, e) for d, e in catalog.documents().items()]
    docs.sort(key=lambda e: (e["added"] or 0, e["doc_id"]))
    return docs


def document_page(
    catalog, kv, offset: int = 0, limit: int = 50, contains: str | None = None
) -> tuple[list[dict[str, Any]], int]:
    """``(entries, total)``: documents ``offset .. offset + limit`` of the store, oldest first,
    each with ``num_tokens`` and ``nbytes`` (its stored chunks' tokens and K/V bytes);
    ``contains``: only documents whose source or doc id contains it (case-insensitive).
    ``total`` counts every matching document."""
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be in [1, {MAX_PAGE}], got {limit!r}")
    docs = sorted_documents(catalog)
    if contains:
        needle = contains.casefold()
        docs = [d for d in docs if needle in f"{d['source'] or ''}\n{d['doc_id']}".casefold()]
    page = docs[offset : offset + limit]
    for entry in page:
        metas = [m for m in chunk_metas(kv, catalog, entry["doc_id"]) if m is not None]
        entry["num_tokens"] = sum(m.num_tokens for m in metas)
        entry["nbytes"] = sum(m.nbytes for m in metas)
        entry["num_stored_chunks"] = len(metas)
    return page, len(docs)
