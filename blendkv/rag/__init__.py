"""blendkv.rag: the RAG pipeline over the chunk-KV store (ingest, retrieve, blended answers).

``RAGPipeline`` is the entry point; see :mod:`blendkv.rag.pipeline`.
"""

from __future__ import annotations

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
from blendkv.rag.ingest import IngestInterrupted
from blendkv.rag.pipeline import RAGPipeline
from blendkv.rag.types import IngestReport, RAGAnswer, RetrievedChunk

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
