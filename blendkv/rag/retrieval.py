"""Retrieval: the chunks closest to a question, each named by its document (source, metadata),
optionally only among the documents a filter selects (:mod:`blendkv.rag.filters`).

A chunk equal in several documents is stored once under one of them (its owner); it is
reported as the owner's, or, under a filter that excludes the owner, as the first selected
document that lists it, at its position there.
"""

from __future__ import annotations

from blendkv.rag.catalog import DocumentCatalog
from blendkv.rag.errors import NoChunksError
from blendkv.rag.filters import DocumentFilter, describe_filter, matching_documents
from blendkv.rag.types import RetrievedChunk


def retrieve_chunks(
    store, catalog: DocumentCatalog, question: str, k: int, filter: DocumentFilter | None = None
) -> list[RetrievedChunk]:
    """The ``k`` chunks of ``store`` (a :class:`~blendkv.rag.chunk_store.ChunkStore`) closest to
    ``question``, best first; the caller holds the pipeline's store lock."""
    documents = catalog.documents()
    allowed: set[str] | None = None
    ids = None
    if filter is not None:
        allowed = set(matching_documents(filter, documents))
        if not allowed:
            raise NoChunksError(
                f"no document matches the filter {describe_filter(filter)} "
                f"({len(documents)} documents; `blendkv docs list` shows them)"
            )
        if len(allowed) < len(documents):
            ids = _chunk_ids(store.kv, catalog, allowed)
    users = None  # chunk key -> doc ids listing it, read only when an owner does not do
    out = []
    for hit in store.search(question, k, ids):
        meta = hit.meta
        doc_id, position = meta.doc_id, meta.position
        if doc_id not in documents or (allowed is not None and doc_id not in allowed):
            users = users if users is not None else catalog.key_documents()
            heirs = [d for d in users.get(meta.key, ()) if allowed is None or d in allowed]
            if heirs:
                doc_id = heirs[0]
                position = catalog.chunk_keys(doc_id).index(meta.key)
        entry = documents.get(doc_id, {})
        out.append(
            RetrievedChunk(
                hit.chunk_id,
                doc_id,
                meta.text,
                hit.score,
                meta.key in store.kv,
                position,
                entry.get("metadata", {}),
                entry.get("source"),
            )
        )
    return out


def _chunk_ids(kv, catalog: DocumentCatalog, doc_ids: set[str]) -> list[int]:
    """The stored chunk ids of the documents ``doc_ids`` (the keys their entries list; the
    chunks they own for an entry written before keys were recorded)."""
    ids = []
    for doc_id in doc_ids:
        keys = catalog.chunk_keys(doc_id)
        if keys is None:
            ids.extend(m.chunk_id for m in kv.document_chunks(doc_id))
            continue
        for key in keys:
            meta = kv.get_meta(key)
            if meta is not None:
                ids.append(meta.chunk_id)
    return ids
