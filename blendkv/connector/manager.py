"""Turns blended prompts into request states and owns the chunk K/V (store, writer).

One manager per engine. It owns the chunk-KV store (LMDB with a memory tier in front), the
background writer that stores chunks computed at query time, the prompt builder and the anchor
every chunk is precomputed behind; the model runner computes chunk K/V, the manager stores it.
The store's fingerprint ties it to this model, dtype,
tokenizer, RoPE configuration and anchor. With ``request_cache_bytes`` (the server), chunks
computed at query time go to a bounded private store read after the main one, never into it
(:mod:`blendkv.store.layered`); without a store directory, the private store is all there is,
bounded too.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from typing import TYPE_CHECKING

import torch
import xxhash

from blendkv.blend.config import BlendConfig
from blendkv.connector.prompt import BlendedPrompt, PromptBuilder, parse_prompt
from blendkv.connector.request_state import BlendRequestState
from blendkv.guards.calibration import (
    DEFAULT_RATIOS,
    UNCALIBRATED_RATIO,
    Calibration,
    load_calibration,
    save_calibration,
)
from blendkv.layers.rotary import rope_parameters
from blendkv.store import (
    FingerprintMismatchError,
    ModelFingerprint,
    NewChunk,
    chunk_key,
    open_kv_store,
)
from blendkv.store.backends import stored_fingerprint
from blendkv.store.base import fill_misses
from blendkv.store.capacity import default_request_cache_bytes
from blendkv.store.fingerprint import mismatch_message
from blendkv.store.kv_store import KVStore
from blendkv.store.layered import LayeredKVStore
from blendkv.store.writer import BackgroundWriter
from blendkv.text import replace_in_blended_prompt

if TYPE_CHECKING:
    from blendkv.guards.fidelity_controller import FidelityController
    from blendkv.store.base import ChunkKVStore

logger = logging.getLogger(__name__)
# How often a calibration kept in a shared (Redis) store is read again: another engine may save
# one (a local store's file is checked on every request, a stat).
SHARED_CALIBRATION_S = 10.0
# a target request holding over this many times the chunks its calibration's prompts held
# gets a warning (once per calibration): its drift may exceed the curve's
CALIBRATION_CHUNKS_SLACK = 1.5


def tokenizer_hash(tokenizer) -> str:
    h = xxhash.xxh3_64()
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}:{token}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class BlendManager:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        architecture: str,
        weights_hash: str,
        dtype: str,
        store_dir: str | None = None,
        store_max_bytes: int | None = None,
        memory_tier_bytes: int = 256 << 20,
        request_cache_bytes: int | None = None,
        anchor_system: str | None = None,
        anchor_instruction: str | None = None,
        anchor_boundary_tokens: int = 0,
        kv_codec: str | None = None,
        fidelity: FidelityController | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # Moves a target's ratio by live audits (the engine's); None: the calibration's alone.
        self.fidelity = fidelity
        self.builder = PromptBuilder(tokenizer)
        # What chunks computed at query time are prefilled behind (request documents, misses)
        self.anchor_ids = self.builder.anchor(anchor_system, anchor_instruction)
        # What the document store's chunks were prefilled behind: this anchor, or, when the
        # engine was given none of its own, an existing store's (follow_store_anchor) or a new
        # RAG pipeline store's, its instruction's (set_store_anchor). The fingerprint names it.
        self.anchor_explicit = anchor_system is not None or anchor_instruction is not None
        self.store_anchor_ids = self.anchor_ids
        self.boundary_tokens = anchor_boundary_tokens
        self.num_layers = model.config.num_hidden_layers
        self.fingerprint = self._fingerprint(model, architecture, weights_hash, dtype, kv_codec)
        self.request_cache_bytes = request_cache_bytes
        # ((store path, its file's stamp), the calibration read)
        self._calibration: tuple[object, Calibration | None] | None = None
        self._calibration_size_warned: Calibration | None = None
        self._tmpdirs: list[tempfile.TemporaryDirectory] = []
        self._private = store_dir is None
        self.store = self._open_store(store_dir, store_max_bytes, memory_tier_bytes)
        self.writer = BackgroundWriter(self.store)

    def _fingerprint(
        self, model, architecture: str, weights_hash: str, dtype: str, kv_codec: str | None
    ) -> ModelFingerprint:
        """What the stored K/V depends on: the model, its tokenizer and the store's anchor."""
        cfg = model.config
        attn = model.model.layers[0].self_attn
        return ModelFingerprint(
            architecture=architecture,
            weights_hash=weights_hash,
            dtype=dtype,
            tokenizer_hash=tokenizer_hash(self.tokenizer),
            rope=rope_parameters(cfg),
            anchor_token_ids=tuple(self.anchor_ids),
            num_layers=self.num_layers,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            kv_codec=kv_codec or "none",  # unset: engine_args.follow_store_dtype filled it in
        )

    def _open_store(
        self, store_dir: str | None, max_bytes: int | None, memory_tier_bytes: int
    ) -> ChunkKVStore:
        """The document store at ``store_dir`` with the request cache in front of it, or with
        no directory a private, bounded store."""
        if store_dir is None:  # no persistent store asked for: a private, bounded one
            store_dir = self._tmpdir()
            if max_bytes is None:
                max_bytes = self.request_cache_bytes or default_request_cache_bytes(store_dir)
        else:
            self.anchor_for_store(store_dir)
        store = open_kv_store(
            store_dir, self.fingerprint, max_bytes=max_bytes, memory_tier_bytes=memory_tier_bytes
        )
        return store if self._private else self._with_request_cache(store)

    def _tmpdir(self) -> str:
        tmp = tempfile.TemporaryDirectory(prefix="blendkv-store-")
        self._tmpdirs.append(tmp)
        return tmp.name

    def _with_request_cache(self, main: ChunkKVStore) -> ChunkKVStore:
        """``main``, or with ``request_cache_bytes`` the layered store that keeps chunk K/V
        computed at query time in a private store of that bound instead of in ``main``."""
        if self.request_cache_bytes is None:
            return main
        try:
            cache = KVStore(
                self._tmpdir(),
                self.fingerprint,
                max_bytes=self.request_cache_bytes,
                memory_tier_bytes=0,
                sync=False,  # a cache deleted at close: no fsync per write
            )
        except BaseException:
            main.close()
            raise
        return LayeredKVStore(main, cache)

    def use_request_cache(self, nbytes: int) -> None:
        """From now on keep chunks computed at query time in a private store of at most
        ``nbytes`` (the server's request-document cache), never in the store documents are
        ingested into; without one, the private store is the cache."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"the request cache needs a positive byte bound, got {nbytes!r}")
        self.writer.flush()
        self.request_cache_bytes = nbytes
        if isinstance(self.store, LayeredKVStore):
            self.store.cache.max_bytes = nbytes
        elif self._private:
            self.store.max_bytes = nbytes
        else:
            self.writer.close()
            self.store = self._with_request_cache(self.store)
            self.writer = BackgroundWriter(self.store)

    @property
    def document_store(self) -> ChunkKVStore:
        """The store documents are written to (without the request cache)."""
        return self.store.main if isinstance(self.store, LayeredKVStore) else self.store

    def flush(self) -> None:
        """Block until every chunk computed at query time so far is in the store."""
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        self.store.close()
        for tmp in self._tmpdirs:
            tmp.cleanup()
        self._tmpdirs = []

    def set_store_anchor(self, anchor_ids: list[int]) -> None:
        """Ingest chunks behind ``anchor_ids`` and look prompts' chunks up behind it first
        (the fingerprint follows); call it before :meth:`use_store` opens a store with the new
        fingerprint. Chunks computed at query time stay behind :attr:`anchor_ids`."""
        self.store_anchor_ids = list(anchor_ids)
        self.fingerprint = dataclasses.replace(self.fingerprint, anchor_token_ids=tuple(anchor_ids))

    def anchor_for_store(self, store_dir: str, new_anchor_ids: list[int] | None = None) -> None:
        """Before the store at ``store_dir`` opens, unless this engine has an anchor of its
        own (a store built behind another one is then refused): follow the store's anchor;
        for a store not made yet, ``new_anchor_ids`` when given."""
        if self.anchor_explicit:
            return
        stored = stored_fingerprint(store_dir)
        if stored is not None:
            self.follow_store_anchor(stored)
        elif new_anchor_ids is not None:
            self.set_store_anchor(new_anchor_ids)

    def follow_store_anchor(self, stored: ModelFingerprint | None) -> None:
        """Take the anchor of a store built with ``stored`` (its chunks were precomputed
        behind it); whatever else differs, opening the store names it."""
        if stored is not None and stored.anchor_token_ids != self.fingerprint.anchor_token_ids:
            logger.info("following the store's anchor (%d tokens)", len(stored.anchor_token_ids))
            self.set_store_anchor(list(stored.anchor_token_ids))

    def use_store(self, store: ChunkKVStore) -> None:
        """Serve chunk K/V from ``store`` (opened with :attr:`fingerprint`), e.g. the
        one inside a ``ChunkStore``, behind a new request cache when there is one; the previous
        store (and request cache) is closed."""
        theirs = store.fingerprint
        if theirs is not None and theirs != self.fingerprint:
            raise FingerprintMismatchError(
                mismatch_message(store.path, self.fingerprint, theirs),
                self.fingerprint.diff(theirs),
            )
        self.close()
        self._private = False
        self.store = self._with_request_cache(store)
        self.writer = BackgroundWriter(self.store)

    # ------------------------------------------------------------- requests
    def chunk_key(self, chunk_ids: list[int], context: list[int] | None = None) -> bytes:
        """The store key of a chunk precomputed behind ``context`` (default: the store's
        anchor, as ingest stores it)."""
        anchor = self.store_anchor_ids if context is None else context
        return chunk_key(self.fingerprint, anchor, chunk_ids)

    def chunk_contexts(self, chunks: list[list[int]]) -> list[list[int]]:
        """What each chunk of a prompt is precomputed behind: the anchor, and with
        ``anchor_boundary_tokens`` N also the last N tokens of the chunk before it (so its K/V
        is reused only where the same chunk follows the same neighbour); a chunk stored behind
        the store's own anchor (:attr:`store_anchor_ids`, when it differs) is taken from there."""
        n = self.boundary_tokens
        contexts = [
            self.anchor_ids + (chunks[i - 1][-n:] if n and i else []) for i in range(len(chunks))
        ]
        if self.store_anchor_ids != self.anchor_ids:
            # a chunk ingested into the store (behind its anchor alone) is served from there
            keys = [self.chunk_key(chunk, self.store_anchor_ids) for chunk in chunks]
            for i, stored in enumerate(self.has_many(keys)):
                if stored:
                    contexts[i] = self.store_anchor_ids
        return contexts

    def prepare(self, prompt: dict, config: BlendConfig | None) -> BlendRequestState:
        """Parse a blended prompt dict (see ``blendkv.blend``) into its request state.

        Raises on bad input."""
        config = config or BlendConfig()
        target = config.fidelity_target if config.target_mode else None
        calibration = predicted = None
        if target is not None:  # the least ratio the store's calibration says meets it
            config, predicted, calibration = self._for_target(config)
        config.validate_for(self.num_layers)
        prompt = replace_in_blended_prompt(prompt)  # lone surrogates -> U+FFFD, with a warning
        parts = parse_prompt(prompt, self.builder.encode, self._stored_tokens)
        chunks = parts.chunks
        built = self.builder.build(
            chunks, parts.query, parts.system, parts.instruction, parts.continuation
        )
        contexts = self.chunk_contexts(chunks)
        keys = [self.chunk_key(c, ctx) for c, ctx in zip(chunks, contexts, strict=True)]
        salt = self._salt(built, keys, config)
        state = BlendRequestState(
            prompt=built, config=config, chunk_keys=keys, salt=salt, chunk_contexts=contexts
        )
        state.stats.num_chunks = len(chunks)
        state.stats.num_prompt_tokens = len(built.token_ids)
        if target is not None:
            state.stats.fidelity_target = target
            state.stats.calibrated = calibration is not None
            state.stats.predicted_recompute_ratio = predicted
            if calibration is not None:
                state.stats.calibration_chunks = calibration.chunks_per_prompt
                self._check_calibration_size(calibration, len(chunks))
            state.stats.chosen_recompute_ratio = config.recompute_ratio
        return state

    def _for_target(self, config: BlendConfig) -> tuple[BlendConfig, float, Calibration | None]:
        """``config`` with the ratio to run its target at, the ratio the calibration picks for
        it (the conservative one without a calibration) and the calibration that picked it.
        The ratio run is the fidelity controller's: that pick moved along the calibration's
        grid by live audits."""
        calibration = self.calibration()
        if calibration is None:  # a target of 0 asks for full prefill's answer
            predicted = UNCALIBRATED_RATIO if config.fidelity_target > 0 else 1.0
            grid = DEFAULT_RATIOS
        else:
            predicted = calibration.ratio_for(config.fidelity_target)
            grid = calibration.ratios
        ratio = predicted
        if self.fidelity is not None:
            ratio = self.fidelity.ratio_for(config.fidelity_target, predicted, grid)
        resolved = dataclasses.replace(config, recompute_ratio=ratio, fidelity_target=None)
        return resolved, predicted, calibration

    def _check_calibration_size(self, calibration: Calibration, num_chunks: int) -> None:
        """Warn, once per calibration, when a target request holds well over the chunks the
        calibration's prompts did: drift grows with a prompt's chunks, so its pick may be low
        (docs/guide/fidelity.md)."""
        measured = calibration.chunks_per_prompt
        if not measured or num_chunks <= CALIBRATION_CHUNKS_SLACK * measured:
            return
        if self._calibration_size_warned is calibration:
            return
        self._calibration_size_warned = calibration
        logger.warning(
            "a request holds %d chunks; the store's calibration measured prompts of %d, so its "
            "ratios may be too low for it: run `blendkv calibrate --chunks-per-prompt %d`",
            num_chunks,
            measured,
            num_chunks,
        )

    def save_calibration(self, calibration: Calibration) -> str:
        """Keep ``calibration`` with the document store (this engine reads it from now on);
        returns where it went."""
        where = save_calibration(calibration, self.document_store)
        self._calibration = None
        return where

    def calibration(self) -> Calibration | None:
        """The calibration kept with the document store for this model. Read again when its
        file changed (one saved by this process, e.g. by ``calibrate``, is seen), or from a
        Redis store at most every :data:`SHARED_CALIBRATION_S` seconds (another engine may
        save one)."""
        store = self.document_store
        if store.tier == "redis":
            stamp = int(time.monotonic() // SHARED_CALIBRATION_S)
        else:
            stamp = Calibration.stamp(store.path)
        key = (store.path, stamp)
        if self._calibration is None or self._calibration[0] != key:
            self._calibration = (key, load_calibration(store, self.fingerprint.digest()))
        return self._calibration[1]

    def reconfigure(self, state: BlendRequestState, config: BlendConfig) -> BlendRequestState:
        """``state`` blending with ``config`` instead (its prefix-cache salt follows)."""
        config.validate_for(self.num_layers)
        salt = self._salt(state.prompt, state.chunk_keys, config)
        return dataclasses.replace(state, config=config, salt=salt)

    def _stored_tokens(self, chunk_id: int) -> list[int] | None:
        meta = self.store.meta_for_id(chunk_id)
        return None if meta is None else list(meta.token_ids)

    @staticmethod
    def _salt(built: BlendedPrompt, keys: list[bytes], config: BlendConfig) -> bytes:
        """Prefix-cache salt: fused K/V depends on the whole chunk set and the blend config."""
        h = xxhash.xxh3_128()
        h.update(config.cache_key())
        h.update(built.prefix_len.to_bytes(8, "little"))
        for start, key in zip(built.chunk_starts, keys, strict=True):
            h.update(start.to_bytes(8, "little"))
            h.update(key)
        return b"blend:" + h.digest()

    # ---------------------------------------------------------------- chunk K/V
    def has(self, key: bytes) -> bool:
        """The chunk is stored or waiting in the writer (its value may still turn out corrupt)."""
        return self.writer.pending(key) is not None or key in self.store

    def has_many(self, keys: list[bytes]) -> list[bool]:
        """:meth:`has` of each key, the store asked once (Redis: one round trip)."""
        pending = [self.writer.pending(key) is not None for key in keys]
        return fill_misses(pending, keys, self.store.contains_many)

    def pending(self, key: bytes) -> torch.Tensor | None:
        """A chunk computed at query time and still waiting in the background writer."""
        return self.writer.pending(key)

    def write_back(self, keys: list[bytes], chunks: list[list[int]], kvs) -> None:
        """Hand chunks computed at query time to the background writer (returns at once)."""
        self.writer.submit(
            [
                NewChunk(key, kv.cpu(), text=self.tokenizer.decode(ids), token_ids=tuple(ids))
                for key, ids, kv in zip(keys, chunks, kvs, strict=True)
            ]
        )

    def find_missing(self, state: BlendRequestState) -> None:
        """Note the request's chunks whose K/V is neither stored nor waiting in the writer
        (``state.missing``; a chunk given twice is computed once)."""
        keys, seen, missing = state.chunk_keys, set(), []
        for i, (key, stored) in enumerate(zip(keys, self.has_many(keys), strict=True)):
            if key not in seen and not stored:
                missing.append(i)
            seen.add(key)
        state.missing = missing

    def save_precomputed(
        self, state: BlendRequestState, index: int, kv: torch.Tensor, seconds: float
    ) -> None:
        """The runner computed the request's missing chunk ``index`` (in ``seconds``): hand it
        to the background writer and keep it on ``state`` for its fused prefill. A chunk
        another request stored meanwhile is left to the prefill's loading (a store hit)."""
        key = state.chunk_keys[index]
        if not self.has(key):
            self.write_back([key], [state.prompt.chunks[index]], [kv])
            state.precomputed[index] = kv
            state.stats.chunks_missed += 1
        state.missing = [i for i in state.missing if i != index]
        state.stats.precompute_seconds += seconds

    def missing_chunks(
        self, chunks: list[list[int]], contexts: list[list[int]] | None = None
    ) -> tuple[list[bytes], list[int]]:
        """Ingest: each chunk's key behind its context (default: the store's anchor,
        :attr:`store_anchor_ids`), and the indices of those not in the document store yet."""
        self.flush()
        contexts = contexts or [self.store_anchor_ids] * len(chunks)
        keys = [self.chunk_key(c, ctx) for c, ctx in zip(chunks, contexts, strict=True)]
        return keys, [i for i, key in enumerate(keys) if key not in self.document_store]

    def store_chunks(
        self,
        keys: list[bytes],
        chunks: list[list[int]],
        kvs,
        texts: list[str] | None = None,
        doc_id: str | None = None,
        positions: list[int] | None = None,
    ) -> list:
        """Ingest: put computed chunks into the document store in one transaction; a PutResult
        per chunk (``positions``: each one's place in its document; default 0, 1, ...)."""
        new = [
            NewChunk(
                key,
                kv.cpu(),
                text=texts[i] if texts is not None else self.tokenizer.decode(chunk),
                token_ids=tuple(chunk),
                doc_id=doc_id,
                position=positions[i] if positions is not None else i,
            )
            for i, (key, chunk, kv) in enumerate(zip(keys, chunks, kvs, strict=True))
        ]
        return self.document_store.put_many(new)
