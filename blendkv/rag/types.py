"""Plain result types of the RAG pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RetrievedChunk:
    """One retrieved chunk. ``score`` is the index similarity (higher is closer);
    ``kv_cached`` is True when the chunk's K/V is in the store (the blend will hit it).
    ``source`` and ``metadata`` are the document's, from the catalog (``source``: the file
    path or title it was ingested from, None for a bare text)."""

    chunk_id: int
    doc_id: str | None
    text: str
    score: float
    kv_cached: bool
    position: int = 0  # the chunk's index within its document
    metadata: dict[str, Any] = field(default_factory=dict)  # the document's metadata
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
    """A generated answer, the chunks it was generated from (in prompt order), the blend stats
    (:class:`blendkv.connector.request_state.BlendStats`) and the time to first token in seconds.
    ``prompt`` is the blended prompt dict it was generated from (:mod:`blendkv.rag.explain`
    shows and replays it)."""

    answer: str
    sources: list[RetrievedChunk]
    blend_stats: Any
    ttft: float | None
    finish_reason: str | None = None
    prompt: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
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

    ``added``, ``skipped`` and ``repaired`` are doc ids (skipped = already in the store,
    nothing written; repaired = left behind by an interrupted ingest, now made whole: its
    stored chunks were kept, the missing ones computed). ``num_chunks`` counts the chunks
    computed and written by this call, ``reused_chunks`` the chunks of its added and repaired
    documents that were already stored (not computed again). ``sources`` lists each
    document's source (a path, a title, None), like ``doc_ids``. ``replaced`` holds
    ``(old doc id, new doc id)``: an older version of the same source, removed once the new
    one was stored. ``skipped_files``: the unreadable files of folders and globs, not ingested.
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
    skipped_files: tuple[Any, ...] = ()  # blendkv.rag.documents.SkippedFile

    def summary(self) -> str:
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
