"""blendkv.rag: the RAG pipeline over the chunk-KV store (ingest, retrieve, blended answers).

``RAGPipeline`` is the entry point; see :mod:`blendkv.rag.pipeline`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from blendkv.rag.chunk_order import ChunkOrderError
from blendkv.rag.errors import (
    DocumentError,
    EmptyDocumentError,
    InvalidFilterError,
    NoChunksError,
    RAGError,
    UnknownDocumentError,
    UnreadableDocumentError,
)
from blendkv.rag.types import IngestReport, RAGAnswer, RetrievedChunk

if TYPE_CHECKING:
    from blendkv.rag.ingest import IngestInterrupted
    from blendkv.rag.pipeline import RAGPipeline

__all__ = [
    "ChunkOrderError",
    "DocumentError",
    "EmptyDocumentError",
    "IngestInterrupted",
    "IngestReport",
    "InvalidFilterError",
    "NoChunksError",
    "RAGAnswer",
    "RAGError",
    "RAGPipeline",
    "RetrievedChunk",
    "UnknownDocumentError",
    "UnreadableDocumentError",
]


def __getattr__(name: str) -> Any:
    # The pipeline loads torch and transformers (seconds): a module of this package that needs
    # neither (documents, chunking: a Ray worker reading files) does not wait for them.
    if name == "RAGPipeline":
        from blendkv.rag.pipeline import RAGPipeline

        return RAGPipeline
    if name == "IngestInterrupted":
        from blendkv.rag.ingest import IngestInterrupted

        return IngestInterrupted
    raise AttributeError(f"module 'blendkv.rag' has no attribute {name!r}")
