"""Typed errors of the chunk-KV store and its FAISS index.

All derive from :class:`StoreError`, itself a :class:`blendkv.errors.BlendKVError`, so a caller
can catch every store problem with one clause and still tell them apart.
"""

from __future__ import annotations

from blendkv.errors import BlendKVError


class StoreError(BlendKVError):
    """Base class of every error the store raises on purpose."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The store directory does not exist and the store was opened with ``create=False``."""


class StoreReadOnlyError(StoreError, PermissionError):
    """A write was asked of a store opened read-only, or the directory cannot be written."""


class StoreFormatError(StoreError):
    """The directory is not a blendkv store, or one written in another format version."""


class FingerprintMismatchError(StoreError):
    """The store was built for another model; ``fields`` names the fields that differ."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class CorruptValueError(StoreError):
    """A stored value failed its header or checksum check (the store treats it as a miss)."""


class CodecMismatchError(CorruptValueError):
    """A value encoded with another K/V codec than the store's (``blendkv.store.codecs``):
    refused on a write; on a read it is a corrupt value (a miss). Names both codecs."""

    def __init__(self, message: str, value_codec: str = "", store_codec: str = "") -> None:
        super().__init__(message)
        self.value_codec, self.store_codec = value_codec, store_codec


class EmbedderMismatchError(StoreError):
    """A saved FAISS index was built with another embedder (name or dimension)."""


class StoreFullError(StoreError):
    """A write does not fit: the store's byte limit (after evicting every chunk that no document
    owns) or the free disk. Nothing of the failed write is stored."""
