"""Ingest: documents in, chunk K/V, embeddings and catalog entries out.

    inputs ─> load_inputs ─> chunk on token ids ─> plan (skip / add / catalog / resume)
           ─> prefill the chunks not yet stored ─> ChunkStore (LMDB + FAISS, in step)
           ─> catalog entry (last: a document is listed only once its chunks are stored)
           ─> older versions of the same source removed (replace on re-ingest)

Chunks are content-addressed, so a chunk whose key is stored is never computed again: a
re-run after an interruption resumes where it stopped, and an edited file recomputes only its
changed chunks. Ctrl-C keeps what was stored and raises :class:`IngestInterrupted` (a
``KeyboardInterrupt``) saying so; any other failure removes the chunks this call wrote for the
document it was writing.

:class:`DocumentIngester` is the ingest half of a :class:`~blendkv.rag.RAGPipeline`. It reads
the pipeline's current ``store``, ``catalog``, ``manager`` and ``llm`` on every call (not copies
taken at construction), so a pipeline that swaps or closes its store is seen at once. The
caller holds the pipeline's ingest lock; index and catalog changes take its store lock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from blendkv.rag.chunking import chunk_token_ids
from blendkv.rag.consistency import DocumentAction, document_action
from blendkv.rag.deletion import delete_document
from blendkv.rag.documents import LoadedInputs, SourceDocument, content_doc_id, load_inputs
from blendkv.rag.errors import DocumentError, EmptyDocumentError, RAGError
from blendkv.rag.types import IngestReport
from blendkv.store import NewChunk
from blendkv.store.capacity import IngestPlan, plan_ingest

logger = logging.getLogger(__name__)

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


class IngestInterrupted(KeyboardInterrupt):
    """Ctrl-C (or, in the CLI, SIGTERM) during an ingest. What was stored stays: ``done``
    documents are complete, and ``stored_chunks`` of the ``num_chunks`` chunks of ``doc_id``
    (from ``source``) are in the store, so the same ingest run again computes only the
    others.

    Attributes:
        done: the doc ids stored in full.
        doc_id: the document being ingested when it stopped.
        source: that document's source (a path or title; None for a bare text).
        stored_chunks: how many of its chunks are stored.
        num_chunks: how many chunks it has.
    """

    def __init__(
        self, done: tuple[str, ...], doc_id: str, source: str | None, stored: int, total: int
    ) -> None:
        self.done, self.doc_id, self.source = done, doc_id, source
        self.stored_chunks, self.num_chunks = stored, total
        super().__init__(self.message())

    def message(self, by: str | None = None) -> str:
        """What was kept; ``by`` names what interrupted (e.g. ``"SIGTERM"``)."""
        by = f" by {by}" if by else ""
        return (
            f"interrupted{by}: {len(self.done)} document(s) stored in full; "
            f"{self.stored_chunks} of {self.num_chunks} chunks of {self.source or self.doc_id} "
            "kept; re-run the same ingest to resume"
        )


@dataclass
class _Plan:
    """What one document needs: its chunks, their keys, the positions to compute."""

    index: int  # the document's position in the input
    doc_id: str
    action: DocumentAction
    pieces: list  # TextChunk of every chunk
    keys: list[bytes]
    todo: list[int]  # chunk positions whose K/V was not stored when planned
    computed: list[int] = dataclasses.field(default_factory=list)  # the ones computed
    reused: int = 0  # positions whose chunk was found in the store (not computed)


class DocumentIngester:
    """Chunk, prefill, store and catalog documents for ``host`` (see the module docstring)."""

    def __init__(self, host: IngestHost) -> None:
        self.host = host

    def ingest(
        self,
        documents,
        metadata,
        doc_ids,
        progress: bool,
        *,
        paths=None,
        texts=None,
        strict: bool = False,
        replace: bool = True,
        on_plan: Callable[[IngestPlan], None] | None = None,
    ) -> IngestReport:
        """:meth:`RAGPipeline.ingest`; the caller holds the pipeline's ingest lock.
        ``on_plan`` is called with the projected size before the capacity check."""
        h = self.host
        t0 = time.perf_counter()
        if h.store is None:
            raise RAGError("the pipeline is closed")
        given = isinstance(documents, LoadedInputs)
        loaded = load_inputs(documents, paths=paths, texts=texts, strict=strict)
        if not given:  # the CLI prints the files it skipped itself
            for s in loaded.skipped:
                logger.warning("skipped %s: %s", s.path, s.reason)
        docs = list(loaded.documents)
        ids = self._doc_ids(docs, doc_ids)
        metas = self._metadata(metadata, docs)
        plans = self._plan(docs, ids)
        total = sum(len(p.todo) for p in plans)
        if total:  # refuse what the store's limit or the disk cannot hold, before any write
            lengths = [len(p.pieces[i].token_ids) for p in plans for i in p.todo]
            capacity = plan_ingest(h.store.kv, lengths)
            if on_plan is not None:
                on_plan(capacity)
            capacity.check()
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="ingest", unit="chunk", disable=not progress or total == 0)
        done: list[str] = []
        try:
            for p in plans:
                self._store_document(p, docs[p.index], metas[p.index], bar, done)
                done.append(p.doc_id)
        finally:
            bar.close()
        replaced = self._replace_old_versions(docs, ids) if replace else []
        written = [p for p in plans if p.action is not DocumentAction.SKIP]
        return IngestReport(
            doc_ids=tuple(ids),
            added=tuple(p.doc_id for p in written if p.action is DocumentAction.ADD),
            skipped=tuple(d for d in ids if d not in {p.doc_id for p in written}),
            num_chunks=sum(len(p.computed) for p in written),
            num_tokens=sum(len(p.pieces[i].token_ids) for p in written for i in p.computed),
            seconds=time.perf_counter() - t0,
            repaired=tuple(p.doc_id for p in written if p.action is not DocumentAction.ADD),
            sources=tuple(d.source for d in docs),
            reused_chunks=sum(p.reused for p in written),
            replaced=tuple(replaced),
            skipped_files=loaded.skipped,
        )

    # ------------------------------------------------------------------------ planning
    def _plan(self, docs: list[SourceDocument], ids: list[str]) -> list[_Plan]:
        """One plan per distinct doc id (first occurrence), SKIP ones included."""
        h = self.host
        kv = h.store.kv
        plans: list[_Plan] = []
        seen: set[str] = set()
        for i, (doc, doc_id) in enumerate(zip(docs, ids, strict=True)):
            pieces = self._chunk(doc, i)
            if doc_id in seen:
                continue
            seen.add(doc_id)
            keys = [h.manager.chunk_key(list(c.token_ids)) for c in pieces]
            action = document_action(h.catalog, kv, doc_id, keys)
            todo = []
            if action is not DocumentAction.SKIP:
                # A key stored with no owner is query-time K/V (evictable, not indexed):
                # computed again and stored as this document's chunk. A key repeated in the
                # document is computed once, at its first position.
                first = {key: pos for pos, key in reversed(list(enumerate(keys)))}
                todo = [
                    pos
                    for key, pos in sorted(first.items(), key=lambda item: item[1])
                    if (meta := kv.get_meta(key)) is None or meta.doc_id is None
                ]
                if todo and action is DocumentAction.CATALOG:
                    action = DocumentAction.RESUME
            plans.append(_Plan(i, doc_id, action, pieces, keys, todo))
        return plans

    def _chunk(self, doc: SourceDocument, index: int):
        h = self.host
        token_ids = h.manager.builder.encode(doc.text)
        if not token_ids:
            raise EmptyDocumentError(f"document {doc.source or index} has no tokens")
        return chunk_token_ids(token_ids, h.llm.tokenizer, h.chunk_tokens)

    # ------------------------------------------------------------------------- writing
    def _store_document(self, p: _Plan, doc: SourceDocument, meta: dict, bar, done) -> None:
        """Write ``p``'s missing chunks, then its catalog entry. Ctrl-C keeps the chunks
        stored so far; any other failure removes the ones this call stored."""
        if p.action is DocumentAction.SKIP:
            return
        h = self.host
        kv = h.store.kv
        owned_before = {m.key for m in kv.document_chunks(p.doc_id)}
        try:
            self._release_stale(p, owned_before)
            self._write_chunks(p, bar)
            with h._store_lock:
                h.catalog.put(p.doc_id, source=doc.source, metadata=meta, chunk_keys=p.keys)
        except KeyboardInterrupt as e:
            with h._store_lock:  # an interrupt between a store write and its index update
                h.store.sync_index()
            stored = sum(1 for key in p.keys if key in kv)  # what a re-run will not compute
            raise IngestInterrupted(tuple(done), p.doc_id, doc.source, stored, len(p.keys)) from e
        except BaseException:
            mine = [m.key for m in kv.document_chunks(p.doc_id) if m.key not in owned_before]
            with h._store_lock:
                h.store.remove_chunks(mine)
            raise

    def _release_stale(self, p: _Plan, owned: set[bytes]) -> None:
        """Chunks stored under ``p.doc_id`` that its chunks as cut now do not include (cut
        with another ``chunk_tokens``, or another text under a doc id given twice): handed
        to a catalogued document that lists them, else deleted."""
        keys = set(p.keys)
        stale = [k for k in owned if k not in keys]
        if not stale:
            return
        h = self.host
        with h._store_lock:
            users = h.catalog.key_documents()
            moves, doomed = [], []
            for key in stale:
                heirs = [d for d in users.get(key, ()) if d != p.doc_id]
                if heirs:
                    moves.append((key, heirs[0], h.catalog.chunk_keys(heirs[0]).index(key)))
                else:
                    doomed.append(key)
            if moves:
                h.store.kv.reassign(moves)
            h.store.remove_chunks(doomed)

    def _write_chunks(self, p: _Plan, bar) -> None:
        """Compute and store the chunks of ``p.todo`` that are still not stored (an earlier
        document of the batch may have stored some; a key repeated in the document is
        computed once); a stored key no document owns is replaced by this document's chunk."""
        h = self.host
        m = h.manager
        kv = h.store.kv
        todo, orphans, seen = [], [], set()
        for pos in p.todo:
            key = p.keys[pos]
            if key in seen or ((meta := kv.get_meta(key)) is not None and meta.doc_id):
                continue
            seen.add(key)
            todo.append(pos)
            if meta is not None:
                orphans.append(key)
        bar.update(len(p.todo) - len(todo))
        fresh = {p.keys[pos] for pos in todo}
        p.reused = sum(1 for key in p.keys if key not in fresh)
        if orphans:
            with h._store_lock:
                h.store.remove_chunks(orphans)
        for start in range(0, len(todo), WRITE_BATCH):
            positions = todo[start : start + WRITE_BATCH]
            ids = [list(p.pieces[pos].token_ids) for pos in positions]
            with h.llm.exclusive():  # the model is the engine's: not during a step
                runner = h.llm.engine.runner  # one forward per chunk
                kvs = runner.compute_chunk_kv([m.store_anchor_ids] * len(ids), ids)
            new = [
                # The key the blend path computes for these ids, so queries hit it.
                NewChunk(key, kv, p.pieces[pos].text, p.pieces[pos].token_ids, p.doc_id, pos)
                for pos, key, kv in zip(positions, [p.keys[q] for q in positions], kvs, strict=True)
            ]
            with h._store_lock:
                h.store.add_chunks(new)
            p.computed.extend(positions)
            bar.update(len(positions))

    def _replace_old_versions(self, docs: list[SourceDocument], ids: list[str]):
        """Remove the catalogued documents that share a source with one of ``docs`` under
        another doc id (older versions); returns ``(old, new)`` doc id pairs."""
        h = self.host
        mine = set(ids)
        out = []
        with h._store_lock:
            for doc, doc_id in zip(docs, ids, strict=True):
                if doc.source is None:
                    continue
                for old in h.catalog.find(doc.source):
                    if old not in mine and old in h.catalog:
                        delete_document(h.store, h.catalog, old)
                        out.append((old, doc_id))
        return out

    # ------------------------------------------------------------------------ checking
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
    def _metadata(metadata, docs: list[SourceDocument]) -> list[dict]:
        """Each document's own metadata (LangChain, LlamaIndex), updated by ``metadata``. A
        ``"source"`` key is taken out: it names the source of a document that has none (a
        text's title); a file keeps its path. Updates ``docs`` in place."""
        n = len(docs)
        if metadata is None:
            metas = [{} for _ in range(n)]
        else:
            metas = [metadata] * n if isinstance(metadata, dict) else list(metadata)
        if len(metas) != n or not all(isinstance(m, dict) for m in metas):
            raise DocumentError(f"metadata must be one dict or {n} dicts")
        metas = [{**d.metadata, **m} for d, m in zip(docs, metas, strict=True)]
        for i, m in enumerate(metas):
            source = m.pop("source", None)
            if docs[i].source is None and source is not None:
                docs[i] = dataclasses.replace(docs[i], source=str(source))
        try:
            # As the catalog writes it (UTF-8): lone surrogates fail here, not after the chunks.
            json.dumps(metas, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise DocumentError(f"metadata must be JSON-serialisable UTF-8 text: {e}") from e
        return metas


def _is_unicode(text: str) -> bool:
    """False for a string holding lone surrogates (it has no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
