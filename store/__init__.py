"""blendkv.store: persistent chunk K/V (LMDB), a memory tier, and the FAISS chunk index.

Entry points: :func:`open_kv_store` (an LMDB or Redis :class:`ChunkKVStore`, K/V only),
:class:`ChunkStore` (K/V + index kept in step), :func:`chunk_key`, :class:`ModelFingerprint`,
:func:`chunk_token_ids`. Heavy modules (FAISS, transformers) are imported only by the classes
that need them at use time.
"""

from __future__ import annotations

from .backends import open_kv_store
from .base import ChunkKVStore, StoreSnapshot
from .chunking import TextChunk, chunk_token_ids
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
    "ChunkStore",
    "ChunkIndex",
    "CorruptValueError",
    "EmbedderMismatchError",
    "FingerprintMismatchError",
    "KVStore",
    "MemoryTier",
    "MiniLMEmbedder",
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
    "TextChunk",
    "VerifyReport",
    "chunk_key",
    "chunk_token_ids",
    "open_kv_store",
]


def __getattr__(name: str):
    # FAISS and the embedder load on first use, so `import blendkv.store` stays light.
    if name in ("ChunkStore", "SearchHit"):
        from . import chunk_store

        return getattr(chunk_store, name)
    if name == "ChunkIndex":
        from .index import ChunkIndex

        return ChunkIndex
    if name == "MiniLMEmbedder":
        from .embedding import MiniLMEmbedder

        return MiniLMEmbedder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
