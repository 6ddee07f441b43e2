"""Passage order of evaluation prompts (``blendkv eval --chunk-order``).

    source            the data set's own passage order (what every run before the option used)
    relevance_first   best first, ranked like the RAG pipeline's retrieval
    relevance_last    best last, i.e. next to the question

The ranking is the pipeline's: cosine similarity of the default embedder (all-MiniLM-L6-v2)
between the question and each passage's text (title and text, as rendered), so a run measures
the order ``RAGPipeline`` would build from the same passages (:mod:`blendkv.rag.chunk_order`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from blendkv.eval.examples import Example, Passage
from blendkv.rag.chunk_order import CHUNK_ORDERS, check_chunk_order, order_by_relevance
from blendkv.rag.embedding import MiniLMEmbedder

__all__ = ["CHUNK_ORDERS", "order_examples", "relevance_ranks"]


def _passage_text(passage: Passage) -> str:
    return f"{passage.title}\n{passage.text}" if passage.title else passage.text


def relevance_ranks(example: Example, embedder) -> list[int]:
    """Indices of ``example.passages``, most similar to the question first (ties: data order)."""
    vectors = embedder.embed([example.question] + [_passage_text(p) for p in example.passages])
    scores = vectors[1:] @ vectors[0]
    return [int(i) for i in np.argsort(-scores, kind="stable")]


def order_examples(examples: list[Example], order: str, embedder=None) -> list[Example]:
    """``examples`` with their passages in ``order``; ``embedder`` (default MiniLM) ranks them."""
    check_chunk_order(order)
    if order == "source":
        return list(examples)
    embedder = embedder if embedder is not None else MiniLMEmbedder()
    out = []
    for ex in examples:
        ranked = [ex.passages[i] for i in relevance_ranks(ex, embedder)]
        out.append(replace(ex, passages=order_by_relevance(ranked, order)))
    return out
