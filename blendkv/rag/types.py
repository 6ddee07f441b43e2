"""Plain result types of the RAG pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RetrievedChunk:
    """One retrieved chunk (``RAGPipeline.retrieve``, ``RAGAnswer.sources``).

    Attributes:
        chunk_id: the chunk's id in the store.
        doc_id: the id of the document it belongs to (None for a chunk no document owns).
        text: the chunk's text.
        score: the index similarity to the question (higher is closer).
        kv_cached: whether the chunk's K/V is in the store (the blend will hit it).
        position: the chunk's index within its document.
        metadata: the document's metadata, from the catalog.
        source: the file path or title the document was ingested from; None for a bare text.
    """

    chunk_id: int
    doc_id: str | None
    text: str
    score: float
    kv_cached: bool
    position: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    @property
    def label(self) -> str:
        """How the chunk's document is named to a reader: its source, else its doc id."""
        return self.source or self.doc_id or "?"

    def retriever_metadata(self) -> dict[str, Any]:
        """The document's metadata plus source, chunk_id, doc_id, position, score and
        kv_cached: what the LangChain and LlamaIndex retrievers attach to each result.
        ``source`` follows LangChain's loaders (the file path); a document ingested without
        one keeps a ``source`` of its own metadata, if any."""
        metadata = dict(self.metadata)
        if self.source is not None or "source" not in metadata:
            metadata["source"] = self.source
        metadata.update(
            chunk_id=self.chunk_id,
            doc_id=self.doc_id,
            position=self.position,
            score=self.score,
            kv_cached=self.kv_cached,
        )
        return metadata

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (what the server returns as a source)."""
        return {
            "chunk_id": self.chunk_id,
            "doc_id": self.doc_id,
            "source": self.source,
            "position": self.position,
            "score": self.score,
            "kv_cached": self.kv_cached,
            "text": self.text,
            "metadata": dict(self.metadata),
        }


@dataclass
class RAGAnswer:
    """A generated answer and what it was generated from (``RAGPipeline.query``).

    Attributes:
        answer: the generated text.
        sources: the retrieved chunks, in prompt order.
        blend_stats: the :class:`~blendkv.blend.stats.BlendStats` of its blended prefill
            (what was reused, repaired and computed).
        ttft: the time to first token, in seconds.
        finish_reason: "stop", "length" or "abort" (as ``CompletionOutput.finish_reason``).
        prompt: the blended prompt dict it was generated from (:mod:`blendkv.rag.explain`
            shows and replays it).
    """

    answer: str
    sources: list[RetrievedChunk]
    blend_stats: Any
    ttft: float | None
    finish_reason: str | None = None
    prompt: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Answer, ``ttft_s``, finish reason, blend stats and sources as a JSON-ready dict."""
        stats = self.blend_stats.to_dict() if self.blend_stats is not None else None
        return {
            "answer": self.answer,
            "ttft_s": self.ttft,
            "finish_reason": self.finish_reason,
            "blend_stats": stats,
            "sources": [s.to_dict() for s in self.sources],
        }


@dataclass(frozen=True)
class IngestReport:
    """Outcome of :meth:`RAGPipeline.ingest`, one entry per input document, in input order.

    Attributes:
        doc_ids: every input document's id.
        added: doc ids newly stored.
        skipped: doc ids already in the store (nothing written).
        num_chunks: the chunks computed and written by this call.
        num_tokens: the tokens of those chunks.
        seconds: how long the ingest took.
        repaired: doc ids left behind by an interrupted ingest, now made whole (their stored
            chunks were kept, the missing ones computed).
        sources: each document's source (a path, a title, None), like ``doc_ids``.
        reused_chunks: the chunks of the added and repaired documents that were already
            stored (not computed again).
        replaced: ``(old doc id, new doc id)`` pairs: an older version of the same source,
            removed once the new one was stored.
        skipped_files: the unreadable files of folders and globs, not ingested (each with the
            reason; :class:`blendkv.rag.documents.SkippedFile`).
    """

    doc_ids: tuple[str, ...]
    added: tuple[str, ...]
    skipped: tuple[str, ...]
    num_chunks: int
    num_tokens: int
    seconds: float
    repaired: tuple[str, ...] = ()
    sources: tuple[str | None, ...] = ()
    reused_chunks: int = 0
    replaced: tuple[tuple[str, str], ...] = ()
    skipped_files: tuple[Any, ...] = ()

    def summary(self) -> str:
        """One line: documents added, repaired and skipped, chunks computed, time taken."""
        docs = f"{len(self.added)} document(s) added"
        if self.repaired:
            docs += f", {len(self.repaired)} repaired"
        chunks = f"{self.num_chunks} chunks computed ({self.num_tokens} tokens)"
        if self.reused_chunks:
            chunks += f", {self.reused_chunks} reused from the store"
        parts = [f"{docs}, {len(self.skipped)} already stored", chunks]
        if self.replaced:
            parts.append(f"{len(self.replaced)} older version(s) replaced")
        if self.skipped_files:
            parts.append(f"{len(self.skipped_files)} unreadable file(s) skipped")
        return "; ".join(parts) + f"; in {self.seconds:.1f}s"
