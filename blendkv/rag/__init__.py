"""blendkv.rag: the RAG pipeline over the chunk-KV store (ingest, retrieve, blended answers).

``RAGPipeline`` is the entry point; see :mod:`blendkv.rag.pipeline`.
"""

from __future__ import annotations

from blendkv.rag.errors import (
    DocumentError,
    EmptyDocumentError,
    NoChunksError,
    RAGError,
    UnreadableDocumentError,
)
from blendkv.rag.ingest import IngestInterrupted
from blendkv.rag.pipeline import RAGPipeline
from blendkv.rag.types import IngestReport, RAGAnswer, RetrievedChunk

__all__ = [
    "DocumentError",
    "EmptyDocumentError",
    "IngestInterrupted",
    "IngestReport",
    "NoChunksError",
    "RAGAnswer",
    "RAGError",
    "RAGPipeline",
    "RetrievedChunk",
    "UnreadableDocumentError",
]
