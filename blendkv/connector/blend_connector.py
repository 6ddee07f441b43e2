"""Blending as a KV connector: stored chunk K/V in, a fused prefill that repairs it.

Scheduler side: a blended request's prefill runs whole (never chunked) while some chunk token has
no K/V in its blocks yet, and costs the budget what it computes
(``BlendRequestState.estimated_cost``); nothing counts as computed in advance, since every row
runs the layers before the check layer.
Worker side: the runner hands over the chunks it precomputed (:meth:`save_chunk_kv`); before
the forward the chunks are loaded into the request's blocks (:mod:`blendkv.loading.chunk_loader`),
the runner runs ProphetKV's query pass this connector plans (:meth:`query_pass`), and the
forward follows :class:`BlendRowPlan`. The connector never runs the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from blendkv.blend.prophet import plan_query_pass
from blendkv.blend.row_plan import BlendRowPlan
from blendkv.blend.stats import BlendStats
from blendkv.blend.token_map import build_token_map, plain_token_map
from blendkv.connector.config import blend_connector_config
from blendkv.connector.manager import BlendManager
from blendkv.connector.request_state import BlendRequestState
from blendkv.engine.kv_connector import (
    ConnectorPrompt,
    ForwardInputs,
    FusedPrefillCost,
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
)
from blendkv.engine.scheduler_output import PrecomputeWork
from blendkv.guards.cost_check import ModelCosts, apply_choice, qkv_share
from blendkv.guards.start_gate import refused_prompt
from blendkv.loading.chunk_loader import ChunkLoader
from blendkv.loading.controller import LoadingController
from blendkv.loading.device_timer import DeviceStepTimer
from blendkv.loading.layer_load import (
    LayerwiseLoad,
    account_writes,
    resolve_pipelined,
    spare_cpu_core,
)
from blendkv.loading.prefetch import ChunkPrefetcher
from blendkv.models.model_files import weights_hash


@dataclass(frozen=True)
class FusedPrefill:
    """One blended request whose fused prefill runs in this step."""

    index: int  # position of the sequence in the step's batch
    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    block_table: tuple[int, ...]


@dataclass
class BlendConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the worker side about one step."""

    fused: list[FusedPrefill] = field(default_factory=list)
    # Rows of a step of plain prefills only (no fused prefill, no decode): full prefill's rate
    prefill_rows: int = 0


class BlendConnector(KVConnectorBase):
    runs_query_passes = True

    def __init__(self, context: KVConnectorContext) -> None:
        super().__init__(context)
        self._manager = None
        self._loader = None
        self._states: dict[str, BlendRequestState] = {}
        self._metadata: BlendConnectorMetadata | None = None
        self._step = []  # this step's SeqBlends
        self._layer_load = None  # this step's LayerwiseLoad
        self._row_plan = None
        self._forward_start: float | None = None  # this step's blended compute began
        self.controller = LoadingController()
        self.config = blend_connector_config(context.config.kv_connector_config)
        # Layer-wise pipelined loading (pipeline_kv_load: None picks per device); benchmarks
        # switch it between requests to time both paths on the same engine.
        self.pipelined = self.config.pipeline_kv_load
        self._load_stream = None  # CUDA: the side stream of pipelined loads, made once
        self._prefetcher = None  # reads queued requests' chunks ahead (prefetch_kv)
        # None picks per device and store; benchmarks switch it between requests.
        self.prefetch = self.config.prefetch_kv
        self.blend_refused: str | None = None  # why the start gate refused to blend (start_gate)
        # Blend or full prefill by predicted cost (cost_check); benchmarks may switch it.
        self.cost_check = context.config.guards.blend_cost_check
        self._prefill_start: float | None = None
        # CUDA: the device's time of prefill steps, read later without a sync (device_timer)
        self._timer = DeviceStepTimer() if context.info.device.startswith("cuda") else None
        self._prefill_event = self._forward_event = None
        self._graph_captures, self._captures = None, 0  # the step's capture count, at start

    @property
    def manager(self):
        """The chunk-KV store and prompt machinery (:class:`BlendManager`), made on first use."""
        if self._manager is None:
            ctx, conf = self.context, self.config
            self._manager = BlendManager(
                ctx.model,
                ctx.tokenizer,
                architecture=ctx.info.architecture,
                weights_hash=weights_hash(ctx.resolved),
                dtype=ctx.info.dtype,
                store_dir=conf.kv_store_dir,
                store_max_bytes=conf.kv_store_max_bytes,
                memory_tier_bytes=conf.kv_store_memory_bytes,
                kv_codec=conf.kv_codec,
                request_cache_bytes=conf.request_cache_bytes,
                anchor_system=conf.anchor_system,
                anchor_instruction=conf.anchor_instruction,
                anchor_boundary_tokens=conf.anchor_boundary_tokens,
                fidelity=ctx.fidelity,
            )
            info = ctx.info
            # On CUDA, values read from storage land in pinned memory (async copies).
            self._manager.store.pin_memory = info.device.startswith("cuda")
            self._loader = ChunkLoader(
                self._manager,
                (info.num_layers, info.num_kv_heads, info.head_dim),
                info.device,
                self.controller,
                ctx.model.model.embed_tokens.weight.dtype,
                device_cache_bytes=conf.kv_device_cache_bytes,
                read_mode=conf.kv_read_mode,
            )
            self._loader.layer_windows = [
                getattr(layer.self_attn, "sliding_window", None) for layer in ctx.model.model.layers
            ]
        return self._manager

    @property
    def prefetcher(self):
        """The :class:`ChunkPrefetcher` of the manager's current store (None when off)."""
        store = self.manager.store
        # LMDB on the CPU is read in place from its memory map: warming the page cache is the
        # read (mostly waiting on the disk). Elsewhere values are read into memory and held.
        in_place = self.context.info.device == "cpu" and store.reads_in_place
        setting = self.prefetch
        if setting is None:
            setting = self.context.info.device != "cpu" or in_place or spare_cpu_core()
        if not setting:
            return None
        if self._prefetcher is not None and self._prefetcher.store is not store:
            self._prefetcher.close()  # the manager switched stores (BlendManager.use_store)
            self._prefetcher = None
        if self._prefetcher is None:
            budget = self.config.prefetch_kv_bytes
            self._prefetcher = ChunkPrefetcher(store, hold=not in_place, max_bytes=budget)
        self._loader.prefetcher = self._prefetcher
        return self._prefetcher

    def held_chunks(self) -> tuple[int, list[bytes], list[bytes]]:
        """``(generation, keys in the host-memory tier, keys in the device tier)``: what a
        replica reports to its router (:mod:`blendkv.entrypoints.ray_serve.routing`). The
        generation moves whenever a key enters or leaves either tier."""
        gen, memory = self.manager.store.memory_tier.keys_at()
        tier = self._loader.device_tier
        on_device, device = tier.keys_at() if tier is not None else (0, [])
        return gen + on_device, memory, device

    def store_chunk_seconds(self) -> float | None:
        """Seconds a chunk's load costs more from the store than from the host-memory tier
        (this engine's moving averages; at least 0), None until both were measured: what a
        replica reports to its router with :meth:`held_chunks`."""
        store = self.controller.chunk_seconds(self.manager.store.tier)
        memory = self.controller.chunk_seconds("memory")
        if store is None or memory is None:
            return None
        return max(0.0, store - memory)

    # ---- requests -----------------------------------------------------------------------
    def prepare_prompt(self, prompt: dict, options, token_map: bool = False) -> ConnectorPrompt:
        state = self.manager.prepare(prompt, options)
        state.token_map = token_map
        if self.blend_refused:  # the start gate failed: full prefill of the same tokens
            return refused_prompt(state, self.blend_refused)
        if state.stats.fidelity_target is not None and state.config.recompute_ratio >= 1.0:
            reason = "the fidelity target needs every token recomputed: full prefill"
            return refused_prompt(state, reason)
        if options is not None:  # the request's own config: quality is the user's call
            state.stats.cost_reason = "the request's own BlendConfig: run as given"
        elif self.cost_check:
            state = self._choose(state)
            if state.stats.cost_choice == "full_prefill":
                return refused_prompt(state, state.stats.cost_reason)
        state.stats.config = state.config
        return ConnectorPrompt(
            state.prompt.token_ids,
            cache_salt=state.salt,
            kv_transfer_params=state,
            # Rows before the query may stop being computed after the check layer.
            min_logits_position=state.prompt.query_start if state.prompt.chunks else 0,
            approximate=bool(state.chunk_keys),  # a chunkless prompt is full prefill
            stats=state.stats,
        )

    def _choose(self, state: BlendRequestState) -> BlendRequestState:
        """``state`` with the cost check's choice in its stats (and config, when cheaper)."""
        ctx, info = self.context, self.context.info
        if self._timer is not None:  # the spans the device has finished since
            self._timer.collect(self.controller)
        loader = self._loader
        nbytes = 2 * info.num_kv_heads * info.head_dim * loader.itemsize
        model = ModelCosts(info.num_layers, nbytes, qkv_share(ctx.model))
        overlapped = resolve_pipelined(self.pipelined, loader.device, ctx.attn_backend)
        return apply_choice(
            state, self.manager, self.controller, model, overlapped, loader.device_tier
        )

    def add_request(self, request_id: str, kv_transfer_params) -> None:
        if isinstance(kv_transfer_params, BlendRequestState):
            self._states[request_id] = kv_transfer_params
            self.manager.find_missing(kv_transfer_params)  # computed as precompute work
            prefetcher = self.prefetcher
            if prefetcher is not None and kv_transfer_params.chunk_keys:
                prefetcher.submit(request_id, self._to_read(kv_transfer_params.chunk_keys))

    def _to_read(self, keys: list[bytes]) -> list[bytes]:
        """The keys a prefetch reads: stored (a miss is computed in the step), not waiting in
        the background writer, nor (when values are held) in the memory tier already."""
        manager, held = self.manager, self._prefetcher.hold
        tier, on_device = manager.store.memory_tier, self._loader.device_tier or ()
        return [
            k
            for k in keys
            if k not in on_device
            and manager.pending(k) is None
            and not (held and k in tier)
            and manager.has(k)
        ]

    def request_stats(self, seq) -> BlendStats | None:
        state = self._states.get(seq.request_id)
        if state is None:
            return None
        stats = state.stats
        m = seq.metrics
        if m.first_token_time is not None:
            stats.ttft = m.first_token_time - m.arrival_time
        # Also when the prefix cache served every chunk and no fused prefill ran.
        stats.prefix_cached_tokens = max(stats.prefix_cached_tokens, m.num_cached_tokens)
        if state.token_map and stats.token_map is None and m.first_token_time is not None:
            # no fused prefill ran (full prefill, or the prefix cache held every chunk token)
            prompt = state.prompt
            stats.token_map = plain_token_map(
                len(prompt.token_ids),
                prompt.chunk_spans,
                m.num_cached_tokens,
                self.context.info.num_layers,
            )
        return stats

    def request_finished(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        if self._prefetcher is not None:
            self._prefetcher.release(request_id)

    def close(self) -> None:
        if self._prefetcher is not None:  # before the store it reads closes
            self._prefetcher.close()
            self._prefetcher = None
        if self._manager is not None:
            self._manager.close()
            self._manager = self._loader = None

    # ---- scheduler side -----------------------------------------------------------------
    def get_precompute_work(self, seq) -> list[PrecomputeWork]:
        state = self._states.get(seq.request_id)
        if state is None or not state.missing:
            return []
        return state.precompute_work(seq.request_id, self.manager.store_anchor_ids)

    def kv_ready(self, seq) -> bool:
        prefetcher = self._prefetcher
        return prefetcher is None or prefetcher.ready(seq.request_id)

    def fused_prefill_cost(self, seq, num_computed_tokens: int, num_new_tokens: int):
        state = self._states.get(seq.request_id)
        if state is None or not state.needs_fusion(num_computed_tokens):
            return None
        cost = state.estimated_cost(num_new_tokens, self.context.info.num_layers)
        cfg = state.config
        # "auto": the loading controller picks the ratio at load; the pass is planned then
        query_pass = cfg.selection == "prophet" and (
            cfg.auto_ratio or 0.0 < cfg.recompute_ratio < 1.0
        )
        return FusedPrefillCost(cost, query_pass)

    def build_connector_meta(self, scheduler_output) -> BlendConnectorMetadata:
        meta = BlendConnectorMetadata()
        for i, (seq, num_new) in enumerate(scheduler_output.scheduled):
            state = self._states.get(seq.request_id)
            if state is not None and state.needs_fusion(seq.num_computed_tokens):
                meta.fused.append(
                    FusedPrefill(
                        i, seq.request_id, seq.num_computed_tokens, num_new, tuple(seq.block_table)
                    )
                )
        scheduled = scheduler_output.scheduled
        if not meta.fused and all(
            s.num_computed_tokens + n <= s.num_prompt_tokens for s, n in scheduled
        ):
            meta.prefill_rows = sum(n for _, n in scheduled)
        return meta

    # ---- worker side --------------------------------------------------------------------
    def save_chunk_kv(self, work: PrecomputeWork, kv, seconds: float) -> None:
        state = self._states.get(work.request_id)
        if state is not None:  # (not aborted meanwhile)
            self.manager.save_precomputed(state, work.index, kv, seconds)

    def start_load_kv(self, inputs: ForwardInputs) -> None:
        meta = self._metadata
        self._step = []
        plain = meta is not None and meta.prefill_rows > 0 and not meta.fused
        self._prefill_start = time.perf_counter() if plain else None  # full prefill's rate
        self._prefill_event = self._timer.start() if plain and self._timer else None
        self._graph_captures = inputs.captures_graphs
        self._captures = inputs.captures_graphs() if inputs.captures_graphs else 0
        if meta is None or not meta.fused:
            return
        self.manager  # noqa: B018  (the store and loader exist from here on)
        writes = []
        block_size = inputs.kv_caches[0].shape[2]
        device = inputs.kv_caches[0].device
        overlapped = resolve_pipelined(self.pipelined, device, self.context.attn_backend)
        for f in meta.fused:
            state = self._states[f.request_id]
            blend, chunk_writes = self._loader.load(
                f.index,
                state,
                f.num_computed_tokens,
                f.num_new_tokens,
                f.block_table,
                block_size,
                overlapped,
                inputs.precompute,
            )
            self._step.append(blend)
            writes.extend(chunk_writes)
        ctx = self.context
        if device.type == "cuda" and self._load_stream is None:
            import torch

            self._load_stream = torch.cuda.Stream(device=device)
        self._layer_load = LayerwiseLoad(
            ctx.blend_kernels,
            inputs.kv_caches,
            [
                layer.self_attn.rotary_emb.tables(ctx.info.device)
                for layer in ctx.model.model.layers
            ],
            writes,
            pipelined=self.pipelined,
            stream=self._load_stream,
        )
        self._layer_load.start()

    def query_pass(self, inputs: ForwardInputs):
        """ProphetKV's query pass of the step's ``prophet`` sequences (None without one): it
        reads the loaded K/V of every layer, waiting for each layer's writes as the forward
        does (this connector's hooks)."""
        if not self._step:
            return None
        self._begin_forward()
        return plan_query_pass(
            inputs.input_ids,
            inputs.attn_metadata,
            self._step,
            self.context.attn_backend,
            len(inputs.kv_caches),
        )

    def row_plan(self, inputs: ForwardInputs):
        if not self._step:
            return None
        if self._forward_start is None:  # no query pass ran: the forward begins here
            self._begin_forward()
        ctx = self.context
        self._row_plan = BlendRowPlan(
            inputs.attn_metadata,
            self._step,
            ctx.attn_backend,
            ctx.blend_kernels,
            len(inputs.kv_caches),
            qkv_share(ctx.model),
        )
        return self._row_plan

    def _begin_forward(self) -> None:
        """The step's blended compute starts (the query pass, if any, then the forward)."""
        self._forward_start = time.perf_counter()
        self._forward_event = self._timer.start() if self._timer is not None else None

    def needs_layer_hooks(self) -> bool:
        return self._layer_load is not None

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if self._layer_load is not None:
            self._layer_load.wait(layer_idx)

    def wait_for_save(self) -> None:
        """The forward is done: finish the layer writes, account their time, and feed the
        loading controller what this step measured."""
        load = self._layer_load
        if load is None:
            self._record_prefill()
            return
        self._finish_token_maps()
        forward_seconds = time.perf_counter() - self._forward_start
        load.finish()
        account_writes(load, self.controller)
        if self._row_plan is None or self._captured():
            return
        row_layers = self._row_plan.row_layers(self.context.info.num_layers)
        if self._forward_event is not None:  # CUDA: host time says nothing about compute
            self._timer.stop(self._forward_event, "blend", row_layers, load.waited)
        elif load.device.type == "cpu":
            self.controller.record_compute(row_layers, forward_seconds - load.waited)

    def _finish_token_maps(self) -> None:
        """The fused prefills whose requests asked for it: their token maps, from the traces
        the row plan filled."""
        for f, sb in zip(self._metadata.fused, self._step, strict=True):
            state = self._states.get(f.request_id)
            if sb.trace is None or state is None:
                continue
            prompt = state.prompt
            state.stats.token_map = build_token_map(
                len(prompt.token_ids),
                prompt.chunk_spans,
                f.num_computed_tokens,
                self.context.info.num_layers,
                sb.reused,
                sb.trace,
                sb.query_scores,
                sb.exact,
            )

    def _record_prefill(self) -> None:
        """A step of plain prefills only: full prefill's rate (on the CPU: CUDA runs
        asynchronously, host time says nothing about its compute)."""
        if self._prefill_start is None or self._captured():
            return
        rows = self._metadata.prefill_rows * self.context.info.num_layers
        if self._prefill_event is not None:  # CUDA: timed by events, read at a later step
            self._timer.stop(self._prefill_event, "full", rows)
        elif self.context.info.device == "cpu":
            self.controller.record_full_compute(rows, time.perf_counter() - self._prefill_start)

    def _captured(self) -> bool:
        """Whether this step captured CUDA graphs: its time is no rate to learn."""
        captures = self._graph_captures
        return captures is not None and captures() != self._captures

    def clear_connector_metadata(self) -> None:
        meta = self._metadata
        super().clear_connector_metadata()
        if self._layer_load is not None:  # the forward failed: let the writer thread end
            try:
                self._layer_load.finish()
            except Exception:  # noqa: BLE001  (the forward's own error is the one reported)
                pass
        if self._loader is not None:  # after the writes: they may read from the snapshot
            self._loader.end_step()
        if self._prefetcher is not None and meta is not None:
            for f in meta.fused:  # loaded: what was held for them may go
                self._prefetcher.release(f.request_id)
        self._step = []
        self._layer_load = None
        self._row_plan = None
        self._forward_start = None
