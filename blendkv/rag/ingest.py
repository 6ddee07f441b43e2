"""Ingest: documents in, chunk K/V, embeddings and catalog entries out.

    inputs ─> load_documents ─> chunk on token ids ─> document_action (skip / add / repair)
           ─> prefill each chunk behind the anchor ─> ChunkStore (LMDB + FAISS, in step)
           ─> catalog entry (last: a document is listed only once its chunks are stored)

:class:`DocumentIngester` is the ingest half of a :class:`~blendkv.rag.RAGPipeline`. It reads
the pipeline's current ``store``, ``catalog``, ``manager`` and ``llm`` on every call (not copies
taken at construction), so a pipeline that swaps or closes its store is seen at once. The
caller holds the pipeline's ingest lock; index and catalog changes take its store lock.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Protocol

from blendkv.rag.consistency import DocumentAction, document_action
from blendkv.rag.documents import SourceDocument, content_doc_id, load_documents
from blendkv.rag.errors import DocumentError, EmptyDocumentError, RAGError
from blendkv.rag.types import IngestReport
from blendkv.store import NewChunk, chunk_token_ids

# Chunks per store transaction: bounds the K/V held in memory while a document is ingested
# (a 256-token chunk of SmolLM2-135M is ~12 MB in float32).
WRITE_BATCH = 16


class IngestHost(Protocol):
    """What the ingester needs of its pipeline."""

    store: Any  # ChunkStore, None once closed
    catalog: Any  # DocumentCatalog
    manager: Any  # the engine's blend manager (chunk keys, compute_kv, tokenizer)
    llm: Any
    chunk_tokens: int
    _store_lock: threading.RLock


class DocumentIngester:
    """Chunk, prefill, store and catalog documents for ``host`` (see the module docstring)."""

    def __init__(self, host: IngestHost) -> None:
        self.host = host

    def ingest(self, documents, metadata, doc_ids, progress: bool) -> IngestReport:
        """:meth:`RAGPipeline.ingest`; the caller holds the pipeline's ingest lock."""
        h = self.host
        t0 = time.perf_counter()
        if h.store is None:
            raise RAGError("the pipeline is closed")
        docs = load_documents(documents)
        ids = self._doc_ids(docs, doc_ids)
        metas = self._metadata(metadata, len(docs))
        pieces = [self._chunk(doc, i) for i, doc in enumerate(docs)]
        actions: dict[int, tuple[DocumentAction, list[bytes]]] = {}
        seen: set[str] = set()
        for i, doc_id in enumerate(ids):
            if doc_id in seen:
                continue
            seen.add(doc_id)
            keys = [h.manager.chunk_key(list(c.token_ids)) for c in pieces[i]]
            action = document_action(h.catalog, h.store.kv, doc_id, keys)
            if action is not DocumentAction.SKIP:
                actions[i] = (action, keys)
        written = [i for i, (a, _) in actions.items() if a is not DocumentAction.CATALOG]
        total = sum(len(pieces[i]) for i in written)
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="ingest", unit="chunk", disable=not progress or total == 0)
        try:
            for i, (action, keys) in actions.items():
                if action is DocumentAction.REWRITE:
                    self._remove_chunks(ids[i])
                if action is not DocumentAction.CATALOG:
                    self._write_document(ids[i], pieces[i], bar)
                try:
                    with h._store_lock:
                        h.catalog.put(
                            ids[i], source=docs[i].source, metadata=metas[i], chunk_keys=keys
                        )
                except BaseException:
                    if action is not DocumentAction.CATALOG:
                        self._remove_chunks(ids[i])
                    raise
        finally:
            bar.close()
        added = tuple(ids[i] for i, (a, _) in actions.items() if a is DocumentAction.ADD)
        repaired = tuple(ids[i] for i, (a, _) in actions.items() if a is not DocumentAction.ADD)
        return IngestReport(
            doc_ids=tuple(ids),
            added=added,
            skipped=tuple(d for d in ids if d not in added and d not in repaired),
            num_chunks=total,
            num_tokens=sum(len(c.token_ids) for i in written for c in pieces[i]),
            seconds=time.perf_counter() - t0,
            repaired=repaired,
        )

    def _chunk(self, doc: SourceDocument, index: int):
        h = self.host
        token_ids = h.manager.builder.encode(doc.text)
        if not token_ids:
            raise EmptyDocumentError(f"document {doc.source or index} has no tokens")
        return chunk_token_ids(token_ids, h.llm.tokenizer, h.chunk_tokens)

    def _write_document(self, doc_id: str, chunks, bar) -> None:
        h = self.host
        m = h.manager
        try:
            for start in range(0, len(chunks), WRITE_BATCH):
                batch = chunks[start : start + WRITE_BATCH]
                ids = [list(c.token_ids) for c in batch]
                with h.llm.exclusive():  # the model is the engine's: not during a step
                    kvs = m.compute_kv(ids)  # one forward for the batch
                new = [
                    # The key the blend path computes for these ids, so queries hit it.
                    NewChunk(m.chunk_key(i), kv, c.text, c.token_ids, doc_id, start + j)
                    for j, (c, i, kv) in enumerate(zip(batch, ids, kvs, strict=True))
                ]
                with h._store_lock:
                    h.store.add_chunks(new)
                bar.update(len(batch))
        except BaseException:
            self._remove_chunks(doc_id)  # new document: removing it is an exact rollback
            raise

    def _remove_chunks(self, doc_id: str) -> list[int]:
        h = self.host
        with h._store_lock:
            return h.store.remove_document(doc_id)

    @staticmethod
    def _doc_ids(docs: list[SourceDocument], doc_ids) -> list[str]:
        if doc_ids is None:
            return [content_doc_id(d.text) for d in docs]
        doc_ids = [doc_ids] if isinstance(doc_ids, str) else list(doc_ids)
        if len(doc_ids) != len(docs):
            raise DocumentError(f"{len(doc_ids)} doc ids for {len(docs)} documents")
        for d in doc_ids:
            if not isinstance(d, str) or not d or "\x00" in d or not _is_unicode(d):
                raise DocumentError(
                    f"doc id {d!r} must be a non-empty string without NUL or lone surrogates"
                )
        return doc_ids

    @staticmethod
    def _metadata(metadata, n: int) -> list[dict]:
        if metadata is None:
            return [{} for _ in range(n)]
        metas = [metadata] * n if isinstance(metadata, dict) else list(metadata)
        if len(metas) != n or not all(isinstance(m, dict) for m in metas):
            raise DocumentError(f"metadata must be one dict or {n} dicts")
        try:
            # As the catalog writes it (UTF-8): lone surrogates fail here, not after the chunks.
            json.dumps(metas, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise DocumentError(f"metadata must be JSON-serialisable UTF-8 text: {e}") from e
        return [dict(m) for m in metas]


def _is_unicode(text: str) -> bool:
    """False for a string holding lone surrogates (it has no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
