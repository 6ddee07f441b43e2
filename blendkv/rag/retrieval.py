"""Retrieval: the chunks closest to a question, each named by its document (source, metadata),
optionally only among the documents a filter selects (:mod:`blendkv.rag.filters`).

A chunk equal in several documents is stored once under one of them (its owner); it is
reported as the owner's, or, under a filter that excludes the owner, as the first selected
document that lists it, at its position there.

Only chunks of catalogued documents are returned. Ingest writes a document's chunks before its
catalog entry, so an interrupted ingest (a crash, SIGKILL) leaves chunks in the store and the
index that no catalogued document lists; they are passed over, and the search widens until
``k`` chunks of catalogued documents are found or the index has no more.
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
    ``question``, best first, each of a catalogued document (selected by ``filter``); the caller
    holds the pipeline's store lock."""
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
    query = store.embedder.embed([question])[0]
    owners = _Owners(catalog, documents, allowed)
    searched = k
    while True:
        out = []
        for hit in store.search_vector(query, searched, ids):
            owner = owners.of(hit.meta)
            if owner is None:  # a chunk of no (selected) catalogued document
                continue
            doc_id, position = owner
            entry = documents[doc_id]
            meta = hit.meta
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
        size = len(store.index) if ids is None else len(ids)
        if len(out) >= k or searched >= size:
            return out[:k]
        searched = min(2 * searched, size)  # passed over some: look further down the ranking


class _Owners:
    """The catalogued document (selected by the filter) a stored chunk is reported under."""

    def __init__(self, catalog: DocumentCatalog, documents: dict, allowed: set[str] | None):
        self.catalog, self.documents, self.allowed = catalog, documents, allowed
        self._users: dict[bytes, list[str]] | None = None  # key -> doc ids listing it

    def of(self, meta) -> tuple[str, int] | None:
        """``(doc_id, position)`` for a chunk's metadata: its owner's, else the first selected
        catalogued document that lists it; None when there is none."""
        doc_id, allowed = meta.doc_id, self.allowed
        if doc_id in self.documents and (allowed is None or doc_id in allowed):
            return doc_id, meta.position
        if self._users is None:  # read only when an owner does not do
            self._users = self.catalog.key_documents()
        for heir in self._users.get(meta.key, ()):
            if allowed is None or heir in allowed:
                return heir, self.catalog.chunk_keys(heir).index(meta.key)
        return None


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
