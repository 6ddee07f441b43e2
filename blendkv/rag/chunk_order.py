"""The order retrieved chunks take in a RAG prompt.

Retrieval returns chunks best first; the prompt may put them in another order::

    relevance_last   (default)  worst ... best | question    the best chunk next to the question
    relevance_first             best ... worst | question    retrieval's own order
    source                      by document, then chunk position (reading order), whatever the
                                scores; documents by their source (path or title), else doc id

Why ``relevance_last`` is the default, and what ``blendkv eval --chunk-order`` measured:
docs/guide/evaluation.md, "Chunk order". Pure Python: no model, no store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from blendkv.errors import ConfigError, InvalidRequestError
from blendkv.rag.errors import RAGError
from blendkv.rag.types import RetrievedChunk

__all__ = [
    "CHUNK_ORDERS",
    "DEFAULT_CHUNK_ORDER",
    "ChunkOrderError",
    "check_chunk_order",
    "order_by_relevance",
    "order_chunks",
    "source_key",
]

CHUNK_ORDERS = ("relevance_last", "relevance_first", "source")
DEFAULT_CHUNK_ORDER = "relevance_last"

T = TypeVar("T")


class ChunkOrderError(RAGError, ConfigError, InvalidRequestError):
    """A chunk order that is not one of :data:`CHUNK_ORDERS`."""


def check_chunk_order(order: object) -> str:
    """``order`` if it names a known chunk order, else :class:`ChunkOrderError`."""
    if not isinstance(order, str) or order not in CHUNK_ORDERS:
        raise ChunkOrderError(
            f"unknown chunk order {order!r}; use one of {', '.join(CHUNK_ORDERS)}"
        )
    return order


def order_by_relevance(best_first: Sequence[T], order: str) -> list[T]:
    """Items ranked best first, in the prompt order of ``relevance_first``/``relevance_last``."""
    if order == "relevance_first":
        return list(best_first)
    if order == "relevance_last":
        return list(best_first)[::-1]
    raise ChunkOrderError(f"{order!r} is not a relevance order (relevance_first, relevance_last)")


def source_key(source: str | None, doc_id: str | None, position: int) -> tuple[str, str, int]:
    """The ``source`` order's sort key of a chunk: its document's source (else its doc id),
    then doc id, then the chunk's position in the document."""
    return (source or doc_id or "", doc_id or "", position)


def _chunk_key(chunk: RetrievedChunk) -> tuple[str, str, int]:
    return source_key(chunk.source, chunk.doc_id, chunk.position)


def order_chunks(
    best_first: Sequence[T], order: str, key: Callable[[T], tuple] = _chunk_key
) -> list[T]:
    """Retrieved chunks (best first, as ``RAGPipeline.retrieve`` returns them) in prompt order;
    ``key`` gives the ``source`` order's key of other kinds of items (:func:`source_key`)."""
    check_chunk_order(order)
    if order == "source":
        return sorted(best_first, key=key)
    return order_by_relevance(best_first, order)
