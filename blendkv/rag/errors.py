"""Typed errors of the RAG layer; all are :class:`blendkv.errors.BlendKVError`.

Store problems (missing store, another model's store, corruption) keep the store's own types
(:mod:`blendkv.store.errors`), which are ``BlendKVError`` too.
"""

from __future__ import annotations

from blendkv.errors import BlendKVError, InvalidRequestError


class RAGError(BlendKVError):
    """Base class of the errors the RAG pipeline raises on purpose."""


class DocumentError(RAGError, InvalidRequestError):
    """A document that cannot be ingested (nothing of the batch is written)."""


class EmptyDocumentError(DocumentError):
    """The document has no text (or only whitespace), or the path holds no documents."""


class UnreadableDocumentError(DocumentError):
    """A file that is missing, binary or not UTF-8 text."""


class NoChunksError(RAGError):
    """Retrieval found nothing to answer from (e.g. the store holds no documents yet)."""


class UnknownDocumentError(RAGError, InvalidRequestError):
    """A doc id or source that names no document of the store's catalog."""


class InvalidFilterError(RAGError, InvalidRequestError):
    """A retrieval filter that is neither a dict of metadata values nor a callable."""
