"""A request's chunks as the router sees them: per chunk, the digests of the store keys a
replica's tiers may hold it under.

The ingress computes them before routing, from what a replica's engine computes keys from
(:class:`KeyRecipe`, asked of one replica at start):

- ``documents``: each document is one chunk (:func:`~blendkv.connector.prompt.parse_prompt`),
  its token ids those of its text alone (:class:`~blendkv.connector.prompt.PromptBuilder`).
  A replica finds it under the store's anchor when it was ingested, else under the query-time
  anchor (:meth:`BlendManager.chunk_contexts <blendkv.connector.manager.BlendManager>`): both
  keys are candidates.
- ``rag``: the ingress retrieves as the replica will (the same FAISS index, rebuilt from the
  shared store's embeddings, the same filter): the retrieved chunks' stored keys.

Anything else (a plain chat, a completion, a body that does not parse) has no chunks: it goes
to the least loaded replica, which also answers a bad request with its own error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from blendkv.connector.prompt import PromptBuilder
from blendkv.entrypoints.ray_serve.routing import key_digest
from blendkv.store import ModelFingerprint, chunk_key

logger = logging.getLogger(__name__)

Chunks = list[list[str]]  # per chunk, the digests of its candidate keys


@dataclass(frozen=True)
class KeyRecipe:
    """What an engine makes chunk keys from (its :class:`BlendManager`): the fingerprint, the
    anchor the store's chunks were computed behind, the query-time anchor, how many tokens of
    the chunk before a chunk are part of its context, and the tokenizer."""

    fingerprint: ModelFingerprint
    store_anchor_ids: tuple[int, ...]
    anchor_ids: tuple[int, ...]
    boundary_tokens: int
    tokenizer: Any

    @classmethod
    def of(cls, manager) -> KeyRecipe:
        return cls(
            manager.fingerprint,
            tuple(manager.store_anchor_ids),
            tuple(manager.anchor_ids),
            manager.boundary_tokens,
            manager.tokenizer,
        )

    def document_chunks(self, builder: PromptBuilder, documents: list[str]) -> Chunks:
        """Candidate digests of each document sent in a request."""
        chunks = [builder.encode(text) for text in documents]
        out = []
        n = self.boundary_tokens
        for i, ids in enumerate(chunks):
            query_time = list(self.anchor_ids) + (chunks[i - 1][-n:] if n and i else [])
            contexts = [list(self.store_anchor_ids), query_time]
            keys = {key_digest(chunk_key(self.fingerprint, ctx, ids)) for ctx in contexts}
            out.append(sorted(keys))
        return out


class RequestChunks:
    """Maps request bodies to their chunks (see the module docstring). ``store_dir``: the
    shared store ``rag`` requests retrieve from (None: they have no chunks here)."""

    def __init__(self, recipe: KeyRecipe, store_dir: str | None = None, embedder=None) -> None:
        self.recipe = recipe
        self.builder = PromptBuilder(recipe.tokenizer)
        self.store = self.catalog = None
        if store_dir is not None:
            from blendkv.rag.catalog import open_catalog
            from blendkv.rag.chunk_store import ChunkStore
            from blendkv.rag.embedding import MiniLMEmbedder

            embedder = embedder if embedder is not None else MiniLMEmbedder()
            self.store = ChunkStore(store_dir, recipe.fingerprint, embedder, readonly=True)
            self.catalog = open_catalog(store_dir, self.store.kv)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def of(self, method: str, path: str, body: bytes) -> Chunks:
        """The chunks of a request (empty when it has none or does not parse)."""
        if method != "POST" or path.rstrip("/") != "/v1/chat/completions" or not body:
            return []
        try:
            return self._chat(json.loads(body))
        except Exception as exc:  # the replica answers a bad request with its own error
            logger.debug("no chunks for routing: %s", exc)
            return []

    def _chat(self, body: dict) -> Chunks:
        from blendkv.entrypoints.openai.protocol import ChatCompletionRequest

        if not isinstance(body, dict) or ("documents" not in body and "rag" not in body):
            return []
        req = ChatCompletionRequest.model_validate(body)
        if req.documents is not None:
            docs = [f"{d.title}\n{d.text}" if d.title else d.text for d in req.documents]
            return self.recipe.document_chunks(self.builder, docs)
        if req.rag is None or self.store is None:
            return []
        return self._retrieved(req)

    def _retrieved(self, req) -> Chunks:
        from blendkv.entrypoints.openai.conversation import split_blended_chat
        from blendkv.rag.retrieval import retrieve_chunks

        _, question, _ = split_blended_chat(req.messages, self.recipe.tokenizer)
        found = retrieve_chunks(self.store, self.catalog, question, req.rag.top_k, req.rag.filter)
        metas = [self.store.kv.meta_for_id(c.chunk_id) for c in found]
        return [[key_digest(m.key)] for m in metas if m is not None]
