"""Finding a fused prefill's chunk K/V and handing it to the layer-wise writer.

Per chunk, before the forward: its K/V from the device tier (``kv_device_cache_bytes``: chunks
kept in device memory, no host-to-device copy), the background writer's pending set, the memory
tier or the store (the controller picks the tier), or, if missing, computed now by the model
runner (``ForwardInputs.precompute``) and handed to the background writer. With a device
tier, a raw chunk loaded whole is copied into device memory by its writes and kept there once
they are done. Sources are used in place (on the CPU,
LMDB values are zero-copy views through one read snapshot per step). On the CPU, LMDB reads
are deferred to a thread behind the full layer; a value found evicted or corrupt then is
computed before the first layer reads it.
The writes themselves: :mod:`blendkv.loading.layer_load`. Call :meth:`ChunkLoader.end_step`
once the step's writes are done. Values of an ``int8`` / ``int4`` store are read as stored
(``get_encoded`` / ``view_encoded``) and stay encoded (:func:`~blendkv.kernels.kv_dequant.as_chunk`)
until the load kernel decodes them into the pool.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import torch

from blendkv.blend.row_plan import SeqBlend
from blendkv.blend.token_map import TokenTrace
from blendkv.blend.window_skip import computed_rows, layer_skips
from blendkv.connector.manager import BlendManager
from blendkv.connector.request_state import BlendRequestState
from blendkv.kernels.kv_dequant import EncodedChunk, as_chunk
from blendkv.loading.controller import LoadingController
from blendkv.loading.layer_load import ChunkWrite
from blendkv.store.base import fill_misses
from blendkv.store.memory_tier import MemoryTier

# The runner's chunk precompute: (contexts, chunks) -> each chunk's K/V.
Precompute = Callable[[list[list[int]], list[list[int]]], list[torch.Tensor]]


class ChunkLoader:
    def __init__(
        self,
        manager: BlendManager,
        kv_shape: tuple[int, int, int],
        device: torch.device | str = "cpu",
        controller: LoadingController | None = None,
        dtype: torch.dtype = torch.float32,
        device_cache_bytes: int = 0,
        read_mode: str = "deferred",
    ) -> None:
        """``kv_shape``: (num_layers, num_kv_heads, head_dim) of a stored chunk; ``dtype``: the
        model's (the stored K/V's); ``device_cache_bytes``: the device tier's budget (0: none);
        ``read_mode``: how values a store reads in place are read
        (``BlendConnectorConfig.kv_read_mode``)."""
        self.manager = manager
        self.kv_shape = kv_shape
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.device = torch.device(device)
        self.controller = controller or LoadingController()
        self._snapshot = None  # this step's LMDB read snapshot (CPU), opened on first use
        self.read_mode = read_mode
        # Reads made while the request was queued (:mod:`blendkv.loading.prefetch`), or None.
        self.prefetcher = None
        # Per layer, its sliding window or None (set by the connector): a full-reuse blend does
        # not load what no window reads (:mod:`blendkv.blend.window_skip`).
        self.layer_windows: list[int | None] = []
        # Chunk K/V kept in device memory (kv_device_cache_bytes), or None; this step's
        # candidates for it: (key, write), kept once the writes are done (end_step).
        self.device_tier = MemoryTier(device_cache_bytes) if device_cache_bytes else None
        self._keep: list[tuple[bytes, ChunkWrite]] = []

    def load(
        self,
        index: int,
        state: BlendRequestState,
        start: int,
        num_new: int,
        block_table,
        block_size: int,
        overlapped: bool = True,
        precompute: Precompute | None = None,
    ) -> tuple[SeqBlend, list[ChunkWrite]]:
        """Find the K/V of the chunks of ``state`` past position ``start`` (the prefix-cache
        hit) for the blocks of ``block_table``; returns the sequence's part of the step's row
        state and the writes into its blocks. ``overlapped``: whether the writes will run
        behind the forward (the loading controller raises an "auto" ratio only then).
        ``precompute``: the runner's chunk precompute, for a chunk found missing now (evicted or
        corrupt since the request's lookup)."""
        t0 = time.perf_counter()
        stats = state.stats
        precompute_before = stats.precompute_seconds
        errors_before = self.manager.store.connection_errors
        stats.prefix_cached_tokens = start
        spans = state.prompt.chunk_spans
        todo = [i for i, (_, e) in enumerate(spans) if e > start]
        computed = self._precomputed(state, todo, precompute)
        table = torch.tensor(block_table, dtype=torch.long)
        rows, writes, layer_bytes, tiers = self._chunk_writes(
            state, todo, start, num_new, computed, precompute, table, block_size
        )
        stats.tokens_reused = int(rows.reused.sum())
        config = self._ratio(state.config, stats, num_new, layer_bytes, overlapped)
        stats.store_errors += self.manager.store.connection_errors - errors_before
        precomputed = stats.precompute_seconds - precompute_before
        stats.load_seconds += time.perf_counter() - t0 - precomputed
        blend = SeqBlend(
            index,
            rows.reused,
            config,
            state.prompt.query_start,
            stats.tokens_reused,
            torch.Generator().manual_seed(config.seed),
            stats,
            chunk_ids=rows.chunk_ids,
            chunk_offsets=rows.chunk_offsets,
            num_chunks=len(spans),
            exact=self._exact_rows(state, todo, start, num_new),
            trace=TokenTrace(num_new, tiers) if tiers is not None else None,
        )
        return blend, writes

    def _chunk_writes(
        self,
        state: BlendRequestState,
        todo: list[int],
        start: int,
        num_new: int,
        computed: dict,
        precompute: Precompute | None,
        table: torch.Tensor,
        block_size: int,
    ) -> tuple[_ChunkRows, list[ChunkWrite], dict[str, int], list[str | None] | None]:
        """The writes of the chunks of ``todo`` into the blocks of ``table``, and what they
        tell: the rows they mark, per tier a mean layer's bytes (for the loading controller),
        per chunk its tier (for the token map; None without one)."""
        spans = state.prompt.chunk_spans
        rows = _ChunkRows(num_new)
        writes: list[ChunkWrite] = []
        layer_bytes: dict[str, int] = {}
        skips = self._window_skips(state, todo, start, state.config.first_partial_layer)
        tiers = [None] * len(spans) if state.token_map else None  # per chunk, for the map
        # Last chunk first: a prefetch thread still reading this request's chunks goes from the
        # first, so the two meet in the middle instead of queueing behind each other.
        for i in reversed(todo):
            lo = rows.mark(i, *spans[i], start)
            write = self._chunk_write(state, i, lo, skips[i], computed, precompute)
            if write is None:
                continue
            if tiers is not None:
                tiers[i] = write.owner[1]
            self._set_slots(write, table, block_size)
            writes.append(write)
            self._count_bytes(write, layer_bytes, state.config.first_partial_layer)
        return rows, writes, layer_bytes, tiers

    def _set_slots(self, write: ChunkWrite, table: torch.Tensor, block_size: int) -> None:
        """``write``'s slots in the blocks of ``table`` (from its positions); both on the
        device."""
        positions = write.positions
        slots = table[positions // block_size] * block_size + positions % block_size
        write.slots = slots.to(self.device, non_blocking=True)
        write.positions = positions.to(self.device, non_blocking=True)

    def _precomputed(
        self, state: BlendRequestState, todo: list[int], precompute: Precompute | None
    ) -> dict[int, torch.Tensor]:
        """K/V of the chunks of ``todo`` computed for this request: in earlier steps
        (precompute work), or now, for a chunk neither stored nor waiting in the writer."""
        computed = state.take_precomputed()
        ask = [i for i in todo if i not in computed]
        stored = self._has([state.chunk_keys[i] for i in ask])
        missing = [i for i, hit in zip(ask, stored, strict=True) if not hit]
        computed.update(self._compute(state, missing, precompute))
        return computed

    def _chunk_write(
        self, state, i: int, lo: int, skips: list[int], computed: dict, precompute
    ) -> ChunkWrite | None:
        """The write of chunk ``i``'s K/V from position ``lo`` on into the pool (positions set,
        slots not yet), found in ``computed``, a tier or the store (a read deferred to the
        loading thread where it can be); None when no loaded layer reads any of it."""
        stats, first = state.stats, state.config.first_partial_layer
        s, e = state.prompt.chunk_spans[i]
        # per loaded layer, a prefix its sliding window never reads: reused, not loaded
        base = min(skips, default=0)
        lo += base
        stats.window_skipped_tokens += sum(skips)
        if lo == e:
            return None
        own = [k - base for k in skips]  # what each layer skips past ``lo``
        keep = (slice(first, None), slice(None), slice(lo - s, None))  # layers, positions
        kv, tier, fetch, recover = computed.get(i), "computed", None, None
        t_fetch = time.perf_counter()
        if kv is None:
            found = self._fetch(state.chunk_keys[i], stats)
            if found is None:  # evicted or corrupt since the lookup: compute it after all
                kv = self._compute(state, [i], precompute)[i]
            else:
                kv, tier = found
                stats.chunks_hit += 1
                stats.chunks_in_memory += tier == "memory"
                if callable(kv):  # read later, in the loading thread
                    view, kv = kv, None
                    fetch = _deferred_fetch(view, keep)
                    recover = _recovery(self, state, i, keep, stats, precompute)
        write = ChunkWrite(
            None if kv is None else kv[keep],
            first,
            torch.arange(lo, e),
            None,
            owner=(stats, tier),
            fetch_seconds=time.perf_counter() - t_fetch,
            fetch=fetch,
            recover=recover,
            layer_skips=own if any(own) else None,
        )
        if lo == s and first == 0:  # the whole chunk: the device tier may keep it
            self._offer(state.chunk_keys[i], write, tier)
        return write

    def _count_bytes(self, write: ChunkWrite, layer_bytes: dict[str, int], first: int) -> None:
        """Count ``write``'s bytes in its request's stats and, per tier, a mean layer's bytes
        (what the loading controller weighs against a layer's compute)."""
        num_layers, kv_heads, head_dim = self.kv_shape
        stats, tier = write.owner
        token_nbytes = 2 * kv_heads * head_dim * self.itemsize
        skips = write.layer_skips or [0] * (num_layers - first)
        loaded_nbytes = sum(len(write.positions) - k for k in skips) * token_nbytes
        stats.kv_bytes_loaded += loaded_nbytes
        layer_nbytes = loaded_nbytes // max(1, num_layers - first)  # a mean layer's
        if tier != "computed" and num_layers > first:
            layer_bytes[tier] = layer_bytes.get(tier, 0) + layer_nbytes

    def _ratio(self, config, stats, num_new: int, layer_bytes, overlapped: bool):
        """``config``, its ``"auto"`` ratio chosen by the loading controller (into ``stats``)."""
        if not config.auto_ratio:
            return config
        ratio = self.controller.choose_ratio(
            config.min_recompute_ratio,
            config.max_recompute_ratio,
            stats.tokens_reused,
            num_new - stats.tokens_reused,
            layer_bytes,
            overlapped,
        )
        stats.chosen_recompute_ratio = ratio
        return dataclasses.replace(config, recompute_ratio=ratio)

    def _exact_rows(self, state, todo: list[int], start: int, num_new: int):
        """bool [num_new]: the rows of chunks whose stored K/V is full prefill's (stored
        behind exactly the prompt's tokens before them, by a lossless codec), or None."""
        if self.manager.fingerprint.kv_codec != "none":
            return None
        tokens = state.prompt.token_ids
        contexts = state.chunk_contexts
        exact = None
        for i in todo:
            s, e = state.prompt.chunk_spans[i]
            context = contexts[i] if contexts else self.manager.anchor_ids
            if len(context) == s and list(context) == tokens[:s]:
                if exact is None:
                    exact = torch.zeros(num_new, dtype=torch.bool)
                exact[max(s, start) - start : e - start] = True
        return exact

    def _has(self, keys: list[bytes]) -> list[bool]:
        """Whether each chunk is on the device, stored or waiting in the writer."""
        tier = self.device_tier or ()
        return fill_misses([key in tier for key in keys], keys, self.manager.has_many)

    def _offer(self, key: bytes, write: ChunkWrite, tier: str) -> None:
        """A whole chunk's write, for the device tier to keep once it is done: computed K/V as
        it is (on the device, owned), a raw stored value through a device copy its writes
        fill (read values may be views of a read snapshot, or in host memory)."""
        dt = self.device_tier
        kv = write.kv
        if dt is None or tier == "device" or not isinstance(kv, torch.Tensor):
            return  # off, already there, a deferred read or an encoded value
        if kv.numel() * kv.element_size() > dt.max_bytes:
            return
        if tier != "computed":
            write.device_copy = torch.empty(kv.shape, dtype=kv.dtype, device=self.device)
        self._keep.append((key, write))

    def _fetch(
        self, key: bytes, stats
    ) -> tuple[torch.Tensor | EncodedChunk | Callable, str] | None:
        """A stored chunk's K/V (read-only, shared with the memory tier; encoded as stored) and
        its tier; for an LMDB view read later (``read_mode="deferred"``), a function that
        reads it instead."""
        if self.device_tier is not None:
            kv = self.device_tier.get(key)
            if kv is not None:
                stats.chunks_on_device += 1
                return kv, "device"
        tensor = self.manager.pending(key)
        if tensor is not None:
            return tensor, "memory"
        got = self.prefetcher.take(key) if self.prefetcher is not None else None
        if got is not None:
            stats.chunks_prefetched += 1
            stats.prefetch_seconds += got.seconds
            if got.kv is not None:  # held: read while the request waited
                return self._placed(as_chunk(got.kv)), "memory"
        store = self.manager.store
        tiers = ["memory", store.tier] if key in store.memory_tier else [store.tier]
        tier = self.controller.choose_tier(tiers)
        viewable = self.device.type == "cpu" and store.reads_in_place
        if self.read_mode != "copy" and viewable and tier != "memory":
            if self._snapshot is None:
                self._snapshot = store.snapshot()
            if self._snapshot is not None:
                if self.read_mode == "deferred":
                    return functools.partial(self._snapshot.view_encoded, key), tier
                value = self._snapshot.view_encoded(key)
                return None if value is None else (as_chunk(value), tier)
        value = store.get_encoded(key, skip_memory_tier=tier != "memory")
        if value is None:
            return None
        return self._placed(as_chunk(value)), tier

    def _placed(self, kv: torch.Tensor | EncodedChunk) -> torch.Tensor | EncodedChunk:
        """A host tensor where the writes take it from: as it is on the CPU or when pinned (the
        side stream copies it), else copied to the device now."""
        if self.device.type == "cpu" or kv.is_pinned():
            return kv
        return kv.to(self.device, non_blocking=True)

    def _window_skips(
        self, state: BlendRequestState, todo: list[int], start: int, first: int
    ) -> dict[int, list[int]]:
        """Per chunk of ``todo``, per loaded layer (``first`` on), how many leading tokens (past
        ``start``) that layer never reads: with a sliding window and no reused row ever
        recomputed (full reuse; why not otherwise: :mod:`blendkv.blend.window_skip`); else 0."""
        num_layers = self.kv_shape[0]
        windows = list(self.layer_windows[first:num_layers])
        unknown = len(windows) != num_layers - first  # windows not set (or not this model's)
        if not state.config.full_reuse or unknown or all(w is None for w in windows):
            return {i: [0] * (num_layers - first) for i in todo}
        loaded = [
            (max(state.prompt.chunk_spans[i][0], start), state.prompt.chunk_spans[i][1])
            for i in todo
        ]
        seq_len = len(state.prompt.token_ids)
        rows = computed_rows(loaded, start, seq_len)
        return dict(zip(todo, layer_skips(loaded, rows, seq_len, windows), strict=True))

    def end_step(self) -> None:
        """The step's writes are done: the device tier keeps the whole chunks they copied
        (a write cut short by a failed step is not kept); release the step's read snapshot
        (views into it die)."""
        for key, w in self._keep:
            if w.device_copy is None:
                self.device_tier.put(key, w.kv)
            elif w.copied_layers == len(w.kv):
                self.device_tier.put(key, w.device_copy)
        self._keep = []
        if self._snapshot is not None:
            self._snapshot.close()
            self._snapshot = None

    def _compute(
        self, state: BlendRequestState, misses: list[int], precompute: Precompute | None
    ) -> dict[int, torch.Tensor]:
        """Have the runner compute the missed chunks (one forward each) and hand them to the
        background writer."""
        if not misses:
            return {}
        assert precompute is not None, "a chunk is missing at load: the runner must compute it"
        t0 = time.perf_counter()
        chunks = [state.prompt.chunks[i] for i in misses]
        contexts = state.chunk_contexts
        contexts = [contexts[i] if contexts else self.manager.store_anchor_ids for i in misses]
        kvs = precompute(contexts, chunks)
        self.manager.write_back([state.chunk_keys[i] for i in misses], chunks, kvs)
        state.stats.precompute_seconds += time.perf_counter() - t0
        state.stats.chunks_missed += len(misses)
        return dict(zip(misses, kvs, strict=True))


class _ChunkRows:
    """Which of a fused prefill's ``num_new`` rows (from position ``start``) are reused chunk
    tokens, of which chunk, at which offset in it (-1: not a chunk token)."""

    def __init__(self, num_new: int) -> None:
        self.reused = torch.zeros(num_new, dtype=torch.bool)
        self.chunk_ids = torch.full((num_new,), -1, dtype=torch.long)
        self.chunk_offsets = torch.full((num_new,), -1, dtype=torch.long)

    def mark(self, i: int, s: int, e: int, start: int) -> int:
        """Chunk ``i`` spans positions ``s .. e``: mark its rows past ``start``; returns its
        first position loaded (past the prefix-cache hit)."""
        lo = max(s, start)
        self.reused[lo - start : e - start] = True
        self.chunk_ids[lo - start : e - start] = i
        self.chunk_offsets[lo - start : e - start] = torch.arange(lo - s, e - s)
        return lo


def _deferred_fetch(
    view: Callable, keep: tuple
) -> Callable[[], torch.Tensor | EncodedChunk | None]:
    """Reads a chunk viewed later: its kept layers and positions, or None if it is gone."""

    def fetch() -> torch.Tensor | EncodedChunk | None:
        value = view()
        return None if value is None else as_chunk(value)[keep]

    return fetch


def _recovery(
    loader: ChunkLoader,
    state: BlendRequestState,
    i: int,
    keep: tuple,
    stats,
    precompute: Precompute | None,
):
    """Computes chunk ``i`` when its deferred read finds it evicted or corrupt."""

    def recover() -> torch.Tensor:
        stats.chunks_hit -= 1
        return loader._compute(state, [i], precompute)[i][keep]

    return recover
