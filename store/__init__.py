"""blendkv.store: persistent chunk K/V (LMDB or Redis) and a memory tier in front of it.

Entry points: :func:`open_kv_store` (an LMDB or Redis :class:`ChunkKVStore`), :func:`chunk_key`,
:class:`ModelFingerprint`. Chunking, embedding and the FAISS index (retrieval) live in
:mod:`blendkv.rag`; its :class:`~blendkv.rag.chunk_store.ChunkStore` keeps a K/V store and an
index in step.
"""

from __future__ import annotations

from .backends import open_kv_store
from .base import ChunkKVStore, StoreSnapshot
from .errors import (
    CorruptValueError,
    EmbedderMismatchError,
    FingerprintMismatchError,
    StoreError,
    StoreFormatError,
    StoreFullError,
    StoreNotFoundError,
    StoreReadOnlyError,
)
from .fingerprint import ModelFingerprint
from .keys import chunk_key
from .kv_store import KVStore
from .memory_tier import MemoryTier
from .records import ChunkKV, ChunkMeta, NewChunk, PutResult, StoreStats, VerifyReport

__all__ = [
    "ChunkKV",
    "ChunkKVStore",
    "ChunkMeta",
    "CorruptValueError",
    "EmbedderMismatchError",
    "FingerprintMismatchError",
    "KVStore",
    "MemoryTier",
    "ModelFingerprint",
    "NewChunk",
    "PutResult",
    "StoreError",
    "StoreFormatError",
    "StoreFullError",
    "StoreNotFoundError",
    "StoreReadOnlyError",
    "StoreSnapshot",
    "StoreStats",
    "VerifyReport",
    "chunk_key",
    "open_kv_store",
]
