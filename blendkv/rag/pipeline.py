"""``RAGPipeline``: ingest documents into a chunk store, retrieve, answer with blended K/V.

    add_documents ─> chunk on token ids ─> prefill each chunk behind the anchor ─> ChunkStore
                                                   (K/V in LMDB + embedding in FAISS, in step)
    query ─> FAISS top-k ─> llm.generate({"chunk_ids": [...], "query": q}) ─> RAGAnswer
                            (stored chunk K/V loaded, ~15 % of tokens recomputed: CacheBlend)

One store directory is opened once per process: the pipeline opens the ``ChunkStore`` and hands
its K/V store to the engine's blend manager, so ingest and generation share it.

Thread-safe: queries from several threads share the ``LLM``'s engine loop (it batches them);
ingests and deletes run one at a time, beside queries; the FAISS index and the catalog change
and are searched under one lock, and an ingest computes chunk K/V between engine steps.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from blendkv.engine_args import check_options, follow_store_dtype
from blendkv.entrypoints.llm import LLM
from blendkv.errors import ConfigError, InvalidRequestError
from blendkv.rag import deletion, listing
from blendkv.rag.catalog import open_catalog
from blendkv.rag.chunk_order import DEFAULT_CHUNK_ORDER, check_chunk_order, order_chunks
from blendkv.rag.chunk_store import ChunkStore
from blendkv.rag.consistency import check_documents
from blendkv.rag.embedding import MiniLMEmbedder
from blendkv.rag.errors import NoChunksError, RAGError
from blendkv.rag.filters import DocumentFilter, check_filter
from blendkv.rag.ingest import DocumentIngester
from blendkv.rag.retrieval import retrieve_chunks
from blendkv.rag.types import IngestReport, RAGAnswer, RetrievedChunk
from blendkv.sampling_params import SamplingParams
from blendkv.store import StoreNotFoundError
from blendkv.store.capacity import IngestPlan, store_max_bytes_arg
from blendkv.store.redis_store import is_redis_url
from blendkv.text import replace_lone_surrogates

DEFAULT_INSTRUCTION = "Answer the question using the passages below.\n\n"


class RAGPipeline:
    """Documents in, answers out, over a persistent chunk-KV store.

    Args:
        store_dir: the store directory (created when missing if ``create``).
        llm: an :class:`~blendkv.LLM`; ``None`` loads the embedded SmolLM2-135M-Instruct in
            ``dtype`` with the engine's prefix cache off, so that every query goes through the
            chunk store and its blend stats say what was reused.
        embedder: the chunk embedder (default all-MiniLM-L6-v2).
        chunk_tokens: target chunk length in tokens (chunks are cut on token ids).
        create: create the store if missing; ``False`` raises ``StoreNotFoundError`` instead.
        instruction: text placed before the passages in every prompt.
        chunk_order: the order of the retrieved chunks in the prompt (``relevance_last``:
            the most relevant next to the question, ``relevance_first`` or ``source``;
            :mod:`blendkv.rag.chunk_order`); a query may name another.
        store_max_bytes: the store's size limit in bytes (or ``"20G"``, ``"500M"``), saved in
            the store (None: the saved one, if any). Past it, chunks no document owns are
            evicted, then an ingest raises ``StoreFullError`` (the document is rolled back).
        **engine_options: ``LLM`` keywords (``dtype``, ``device``, ...) for the model the
            pipeline loads when ``llm`` is None; an unknown one raises ``ConfigError``.

    With ``dtype="auto"`` (the default) the model loads in the dtype an existing store was
    built with. A store built for another model, dtype or anchor raises
    ``FingerprintMismatchError`` (for a dtype, naming the one to pass).

    A pipeline is a context manager (``with RAGPipeline(...) as rag:``); :meth:`close` closes
    the store, and the model when the pipeline loaded it.

    Attributes:
        store_dir: the store's directory (a ``Path``) or Redis URL.
        llm: the :class:`~blendkv.LLM` that answers (the one given, or the one loaded).
        store: the :class:`~blendkv.rag.chunk_store.ChunkStore` (K/V store and index).
        manager: the blend connector's ``BlendManager`` (:mod:`blendkv.connector.manager`):
            builds blended prompts and writes chunk K/V.
        catalog: the documents ingested, by doc id (sources, metadata; :meth:`documents`).
    """

    def __init__(
        self,
        store_dir: str | os.PathLike,
        llm=None,
        embedder=None,
        chunk_tokens: int = 256,
        create: bool = True,
        *,
        instruction: str | None = DEFAULT_INSTRUCTION,
        chunk_order: str = DEFAULT_CHUNK_ORDER,
        store_max_bytes: int | str | None = None,
        **engine_options,
    ) -> None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
        check_options(engine_options, "RAGPipeline")
        if llm is not None and engine_options:
            raise ConfigError(
                f"{', '.join(sorted(engine_options))}: engine options apply only to the model "
                "the pipeline loads (llm=None); this pipeline was given an llm"
            )
        shared = is_redis_url(store_dir)
        self.store_dir = store_dir if shared else Path(store_dir)
        if not shared and not create and not (self.store_dir / "data.mdb").exists():
            # Fail before loading a model.
            raise StoreNotFoundError(
                f"no blendkv store at {self.store_dir}; ingest documents first"
            )
        self.chunk_tokens = chunk_tokens
        self.instruction = instruction
        self.chunk_order = check_chunk_order(chunk_order)
        self._owns_llm = llm is None
        if llm is None:
            # dtype="auto" follows an existing store's dtype (its K/V serves no other).
            options = follow_store_dtype(engine_options, self.store_dir)
            llm = LLM(**{"enable_prefix_caching": False, **options})
        self.llm = llm
        self.store = None
        # _ingest_lock: one ingest or delete at a time (its checks of what is stored stay true
        # while it writes). _store_lock: index and catalog changes and reads (short).
        self._ingest_lock = threading.Lock()
        self._store_lock = threading.RLock()
        try:
            self.manager = llm.blend_manager()
            self._anchor()
            embedder = embedder if embedder is not None else MiniLMEmbedder()
            self.store = ChunkStore(
                self.store_dir,
                self.manager.fingerprint,
                embedder,
                create=create,
                max_bytes=store_max_bytes_arg(store_max_bytes),
            )
            self.manager.use_store(self.store.kv)
            self.catalog = open_catalog(self.store_dir, self.store.kv)
        except BaseException:
            self.close()
            raise

    def _anchor(self) -> None:
        """What this store's chunks are precomputed behind: an existing store's own anchor;
        for a new one, the prefix of this pipeline's prompts (chat template and instruction),
        so that the first passage's K/V is full prefill's and every passage's was computed
        behind the text it follows (unless the engine was given an anchor of its own)."""
        manager = self.manager
        manager.anchor_for_store(self.store_dir, manager.builder.anchor(None, self.instruction))

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the store (and the model, when the pipeline loaded it)."""
        with self._ingest_lock, self._store_lock:
            if self.store is not None:
                self.manager.flush()  # chunk K/V computed at query time lands before the close
                self.store.close()
                self.store = None
        if self._owns_llm and self.llm is not None:
            self.llm.close()
            self.llm = None

    def __enter__(self) -> RAGPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------- ingest
    def add_documents(
        self,
        documents: Any = None,
        metadata: dict | Sequence[dict] | None = None,
        doc_ids: Sequence[str] | None = None,
        *,
        paths: Any = None,
        texts: Any = None,
        progress: bool = True,
    ) -> list[str]:
        """Ingest documents; returns their doc ids in input order (see :meth:`ingest`)."""
        report = self.ingest(
            documents, metadata, doc_ids, paths=paths, texts=texts, progress=progress
        )
        return list(report.doc_ids)

    def ingest(
        self,
        documents: Any = None,
        metadata: dict | Sequence[dict] | None = None,
        doc_ids: Sequence[str] | None = None,
        *,
        paths: Any = None,
        texts: Any = None,
        strict: bool = False,
        replace: bool = True,
        progress: bool = True,
        on_plan: Callable[[IngestPlan], None] | None = None,
    ) -> IngestReport:
        """Chunk, embed, index and precompute the K/V of every new document.

        Inputs are explicit (:mod:`blendkv.rag.documents`): in ``documents`` a ``str`` is a
        text (one that looks like a path is refused), a ``pathlib.Path`` a file or a folder
        of .txt/.md files, and LangChain ``Document`` objects and LlamaIndex nodes are taken as
        they are; ``paths=`` takes files, folders and globs (``"docs/**/*.md"``), ``texts=``
        strings that are texts. An unreadable file in a folder or glob is skipped with a
        warning (``skipped_files``; ``strict=True`` raises instead).
        ``metadata`` is one dict for all documents or one per document (merged over a
        document's own); ``doc_ids`` default to a hash of the text, so re-adding a document
        is a no-op (reported in ``skipped``). Every input is read and validated before
        anything is written.

        Chunks already stored are not computed again: an interrupted ingest run again
        resumes (``repaired``). Ctrl-C keeps what was stored and raises
        :class:`~blendkv.rag.ingest.IngestInterrupted`; another failure removes what this call
        wrote for the document it was writing. With ``replace``, a document whose source
        (path or title) is catalogued under another doc id replaces that older version once
        it is stored (``replaced``). ``on_plan`` receives the projected K/V size
        (:class:`~blendkv.store.capacity.IngestPlan`) before it is checked against the
        store's limit and the free disk.
        """
        with self._ingest_lock:
            # Made per call: an ingester kept on the pipeline would be a reference cycle that
            # keeps a dropped pipeline's model (and its KV pool) alive until the next gc.
            return DocumentIngester(self).ingest(
                documents,
                metadata,
                doc_ids,
                progress,
                paths=paths,
                texts=texts,
                strict=strict,
                replace=replace,
                on_plan=on_plan,
            )

    # -------------------------------------------------------------------- documents
    def has_document(self, doc_id: str) -> bool:
        """Whether a document with this doc id is in the catalog or has chunks stored."""
        with self._store_lock:
            self._check_open()
            return doc_id in self.catalog or bool(self.store.kv.document_chunks(doc_id))

    def verify(self):
        """The store's :meth:`~blendkv.rag.chunk_store.ChunkStore.verify` (values, index) plus the
        catalog's agreement with the store (:func:`~blendkv.rag.consistency.check_documents`)."""
        with self._ingest_lock, self._store_lock:
            self._check_open()
            report = self.store.verify()
            check_documents(self.catalog, self.store.kv, report)
            return report

    def documents(self) -> dict[str, dict[str, Any]]:
        """doc id -> {"source", "metadata", "num_chunks", "added"} of the ingested documents."""
        with self._store_lock:
            return self.catalog.documents()

    def document_page(
        self, offset: int = 0, limit: int = 50, contains: str | None = None
    ) -> tuple[list[dict[str, Any]], int]:
        """``(entries, total)``: one page of the documents, oldest first, with chunk counts,
        tokens and K/V bytes (:func:`blendkv.rag.listing.document_page`)."""
        with self._store_lock:
            self._check_open()
            return listing.document_page(self.catalog, self.store.kv, offset, limit, contains)

    def document_details(self, ref: str) -> list[dict[str, Any]]:
        """The documents ``ref`` names (a doc id, or a source: every document ingested from
        it), each its entry and its chunks' text (``blendkv docs show``); raises
        :class:`~blendkv.rag.errors.UnknownDocumentError` when it names none."""
        with self._store_lock:
            self._check_open()
            kv, catalog = self.store.kv, self.catalog
            return [
                {
                    **listing.document_entry(d, catalog.get(d)),
                    "chunks": listing.document_chunks(kv, catalog, d),
                }
                for d in listing.resolve_documents(catalog, kv, [ref])
            ]

    def delete_document(self, doc_id: str) -> int:
        """Remove a document from store, index and catalog: ``doc_id`` is a doc id, or a
        source (every document ingested from it). Chunks another document shares stay,
        handed to it (:mod:`blendkv.rag.deletion`). Returns how many chunks were removed
        (0 when nothing is named)."""
        with self._ingest_lock, self._store_lock:
            self._check_open()
            doc_ids = self.catalog.find(doc_id) or [doc_id]
            done = [deletion.delete_document(self.store, self.catalog, d) for d in doc_ids]
            return sum(d.removed for d in done)

    # ------------------------------------------------------------------ retrieval
    def retrieve(
        self, question: str, k: int = 6, filter: DocumentFilter | None = None
    ) -> list[RetrievedChunk]:
        """The ``k`` chunks closest to ``question``, best first, each with its document's
        source and metadata. ``filter`` (a dict of metadata, ``source`` or ``doc_id`` values,
        or a callable on the catalog entry; :mod:`blendkv.rag.filters`) searches only the
        documents it selects: ``k`` chunks come back while that many match."""
        self._check_open()
        filter = check_filter(filter)
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequestError("the question is empty")
        question = replace_lone_surrogates(question, "question")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidRequestError(f"k must be a positive integer, got {k!r}")
        if len(self.store.index) == 0:
            raise NoChunksError(
                f"the store at {self.store_dir} holds no chunks; add documents first "
                "(RAGPipeline.add_documents or `blendkv ingest`)"
            )
        with self._store_lock:
            self._check_open()
            out = retrieve_chunks(self.store, self.catalog, question, k, filter)
        if not out:
            raise NoChunksError(f"no chunk of {self.store_dir} matched the question")
        return out

    # ----------------------------------------------------------------- generation
    def order_sources(
        self, sources: Sequence[RetrievedChunk], chunk_order: str | None = None
    ) -> list[RetrievedChunk]:
        """Retrieved chunks (best first, as :meth:`retrieve` returns them) in prompt order:
        ``chunk_order``, else the pipeline's (:mod:`blendkv.rag.chunk_order`)."""
        return order_chunks(sources, self.chunk_order if chunk_order is None else chunk_order)

    def blended_prompt(self, question: str, sources: list[RetrievedChunk], system=None) -> dict:
        """The blended prompt for ``question`` over ``sources`` (stored chunk ids, in the order
        given: :meth:`order_sources` puts retrieval's best-first list in prompt order)."""
        prompt: dict[str, Any] = {
            "chunk_ids": [s.chunk_id for s in sources],
            "query": f"\n\nQuestion: {question.strip()}\nAnswer:",
        }
        if system is not None:
            prompt["system"] = system
        if self.instruction:
            prompt["instruction"] = self.instruction
        return prompt

    def query(
        self,
        question: str,
        k: int = 6,
        sampling_params=None,
        blend=None,
        system=None,
        *,
        filter: DocumentFilter | None = None,
        chunk_order: str | None = None,
        verify: bool = False,
    ) -> RAGAnswer:
        """Retrieve ``k`` chunks (among the documents ``filter`` selects; see :meth:`retrieve`)
        and answer from their stored K/V (blended prefill), the chunks in ``chunk_order``
        (default: the pipeline's); the answer's sources are in that prompt order. ``verify``:
        then check the answer against full prefill of the same prompt tokens
        (``answer.blend_stats.verification``: whether the greedy answers differ, and by how
        much the next-token distributions do)."""
        sources, prompt, params, blend = self._prepare(
            question, k, sampling_params, blend, system, filter, chunk_order
        )
        [out] = self.llm.generate([prompt], params, blend=blend, verify=verify)
        return self._answer(out, sources, prompt)

    def stream_query(
        self,
        question: str,
        k: int = 6,
        sampling_params=None,
        blend=None,
        system=None,
        *,
        filter: DocumentFilter | None = None,
        chunk_order: str | None = None,
    ) -> Iterator[str | RAGAnswer]:
        """Yield the answer's text pieces as they are generated, then the final RAGAnswer
        (arguments as :meth:`query`)."""
        sources, prompt, params, blend = self._prepare(
            question, k, sampling_params, blend, system, filter, chunk_order
        )
        last = None
        for out in self.llm.stream(prompt, params, blend=blend):
            last = out
            if out.delta_text:
                yield out.delta_text
        yield self._answer(last, sources, prompt)

    def _prepare(self, question, k, sampling_params, blend, system, filter=None, order=None):
        if order is not None:
            check_chunk_order(order)  # before retrieval's work
        if isinstance(question, str):  # once here, not again in retrieve and the prompt
            question = replace_lone_surrogates(question, "question")
        sources = self.order_sources(self.retrieve(question, k, filter), order)
        params = sampling_params or SamplingParams(max_tokens=128, temperature=0.0)
        return (
            sources,
            self.blended_prompt(question, sources, system),
            params,
            blend,  # None: the engine's default, and its cost check (guards.cost_check)
        )

    @staticmethod
    def _answer(out, sources: list[RetrievedChunk], prompt: dict) -> RAGAnswer:
        return RAGAnswer(
            answer=out.text.strip(),
            sources=sources,
            blend_stats=out.blend_stats,
            ttft=out.metrics.ttft,
            finish_reason=out.outputs[0].finish_reason,
            prompt=prompt,
        )

    def _check_open(self) -> None:
        if self.store is None:
            raise RAGError("the pipeline is closed")
