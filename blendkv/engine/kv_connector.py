"""The KV connector: how stored K/V reaches the engine (and how new K/V is saved).

Shaped like vLLM v1's ``KVConnectorBase_V1``: one object with a scheduler side and a worker side.
It finds, prefetches, loads and saves K/V and decides what a request needs; it never runs the
model: every forward (the batch, chunk precompute, a query pass, an audit) is the model
runner's. The engine sees only this interface; blending
(:class:`blendkv.connector.blend_connector.BlendConnector`) is one implementation, a test's
dict-backed connector another. Configured with ``EngineConfig(kv_connector=...)``.

    request in ──prepare_prompt / add_request──▶ connector keeps per-request state
    scheduler ──get_precompute_work────────▶ chunks whose K/V must be computed first
              ──kv_ready───────────────────▶ False: its K/V is still being read (it may wait)
              ──get_num_new_matched_tokens──▶ tokens whose K/V comes from outside (skipped)
              ──fused_prefill_cost─────────▶ prefills that must run whole: their cost, and
                                             whether a query pass runs first
              ──update_state_after_alloc───▶ blocks are allocated: remember what to load
              ──build_connector_meta───────▶ KVConnectorMetadata, carried on SchedulerOutput
    runner    ──(precompute forwards) save_chunk_kv(work, kv)
    runner    ──bind_connector_metadata, start_load_kv (K/V into the request's blocks)
              ──query_pass ─▶ (the runner runs it) ──row_plan (rows each layer computes)
    forward   ──wait_for_layer_load(l) / save_kv_layer(l)   (LayerHooks, per layer)
    runner    ──wait_for_save, clear_connector_metadata
    engine    ──request_stats (into RequestOutput.blend_stats), request_finished

Scheduler-side methods are pure Python (ids and ints); tensors appear only on the worker side.
"""

from __future__ import annotations

import importlib
from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from blendkv.errors import ConfigError, InvalidRequestError
from blendkv.models.hooks import LayerHooks

if TYPE_CHECKING:
    import torch

    from blendkv.config import EngineConfig
    from blendkv.engine.scheduler_output import PrecomputeWork, SchedulerOutput
    from blendkv.engine.sequence import Sequence
    from blendkv.guards.fidelity_controller import FidelityController
    from blendkv.kernels.attention import AttentionBackend, AttentionMetadata
    from blendkv.kernels.blend_kernels import BlendKernels
    from blendkv.models.hooks import QueryPass, RowPlan


class FusedPrefillCost(NamedTuple):
    """A prefill that must run whole (a fused blended prefill): its cost in tokens of a step's
    budget, and whether a query pass runs before it."""

    tokens: int
    query_pass: bool = False


class KVConnectorMetadata:
    """What the scheduler side tells the worker side about one step (subclassed)."""


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector is built from (facts of the running engine)."""

    config: EngineConfig
    model: Any  # the causal LM (torch module)
    tokenizer: Any
    attn_backend: AttentionBackend
    blend_kernels: BlendKernels  # the blend's kernels on attn_backend's pool
    info: Any  # RuntimeInfo
    resolved: Any  # the resolved model (paths, for fingerprints)
    # The engine's FidelityController (blendkv.guards.fidelity_controller): fidelity targets
    # resolve to ratios through it; the engine feeds it the audits.
    fidelity: FidelityController | None = None


@dataclass
class ConnectorPrompt:
    """A prompt the connector parsed: its token ids, the salt mixed into its prefix-cache block
    hashes, the connector's own per-request payload (handed back by ``add_request``), and the
    first position whose prompt logits exist (rows before it may skip the last layers)."""

    token_ids: list[int]
    cache_salt: bytes = b""
    kv_transfer_params: Any = None
    min_logits_position: int = 0
    # Its K/V is not exactly full prefill's (reused K/V): the engine's audit may sample it.
    approximate: bool = False
    # The stats object the request's outputs carry (``request_stats``), or None.
    stats: Any = None


@dataclass
class ForwardInputs:
    """The step's tensors, as the worker side sees them. ``precompute``: the runner's chunk
    precompute (``(contexts, chunks) -> K/V``), for a chunk the connector finds evicted or
    corrupt between the step's lookup and its load (the runner runs the forward)."""

    input_ids: torch.Tensor
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    precompute: Callable[[list[list[int]], list[list[int]]], list[torch.Tensor]] | None = None
    # whether this step captures CUDA graphs (its time is no rate to learn)
    captures_graphs: Callable[[], bool] | None = None


class KVConnectorBase(LayerHooks, ABC):
    """Base class. Every method has a do-nothing default (dict prompts are refused), so the
    base class itself is the engine's connector when ``EngineConfig.kv_connector`` is None."""

    # Whether this connector asks for query passes (the engine then sets up their graphs).
    runs_query_passes: bool = False

    def __init__(self, context: KVConnectorContext) -> None:
        self.context = context
        self._metadata: KVConnectorMetadata | None = None

    # ---- requests (engine) --------------------------------------------------------------
    def prepare_prompt(
        self, prompt: dict, options: Any, token_map: bool = False
    ) -> ConnectorPrompt:
        """Parse a dict prompt (raise a typed error on bad input). ``token_map``: the request
        asks for its per-token map (in its stats). Default: not supported."""
        raise InvalidRequestError(
            f"dict prompts need a KV connector that takes them (EngineConfig.kv_connector="
            f"'blend'); this engine's is {type(self).__name__}: pass a string or token ids"
        )

    def add_request(self, request_id: str, kv_transfer_params: Any) -> None:
        """A request was queued (``kv_transfer_params`` from :meth:`prepare_prompt`, or None)."""

    def request_stats(self, seq: Sequence) -> Any:
        """Per-request stats to put on its output (``RequestOutput.blend_stats``), or None."""
        return None

    def request_finished(self, request_id: str) -> None:
        """The request finished or was aborted; drop its state."""

    def close(self) -> None:
        """Flush what is pending and release resources (the engine is shutting down)."""

    # ---- scheduler side -----------------------------------------------------------------
    def get_precompute_work(self, seq: Sequence) -> list[PrecomputeWork]:
        """Chunks whose K/V must be computed before ``seq`` can be admitted, not yet done: one
        forward each, run by the model runner, which hands the result to
        :meth:`save_chunk_kv`. The scheduler spreads them over steps under its token budget
        and holds ``seq`` (no blocks) until this is empty. Pure Python; called again after
        every step."""
        return []

    def kv_ready(self, seq: Sequence) -> bool:
        """False while the connector is still reading a waiting request's K/V ahead of its
        step (asynchronous loading): the scheduler then lets it wait while other work runs,
        and schedules it anyway when nothing else would run."""
        return True

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """How many tokens past ``num_computed_tokens`` (the prefix-cache hit) the connector
        can supply K/V for; the scheduler counts them as computed. Must be side-effect free."""
        return 0

    def fused_prefill_cost(
        self, seq: Sequence, num_computed_tokens: int, num_new_tokens: int
    ) -> FusedPrefillCost | None:
        """None for an ordinary (chunkable) prefill. Else the ``num_new_tokens`` must be
        scheduled in one step: what they cost of the step's token budget, and whether the
        prefill runs a query pass first (see :meth:`query_pass`; the scheduler lists it in
        ``SchedulerOutput.query_passes``)."""
        return None

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """Blocks for ``seq`` are allocated; ``num_external_tokens`` of them are to be loaded."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The worker side's instructions for this step (called once, after scheduling)."""
        return KVConnectorMetadata()

    # ---- worker side --------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def save_chunk_kv(self, work: PrecomputeWork, kv: torch.Tensor, seconds: float) -> None:
        """The runner computed ``work``'s chunk: ``kv`` [num_layers, 2, T, kv_heads, head_dim]
        (K before RoPE, V), in ``seconds``. Store it; ``work`` is then done."""

    def start_load_kv(self, inputs: ForwardInputs) -> None:
        """Start bringing this step's external K/V into the blocks (before the forward)."""

    def query_pass(self, inputs: ForwardInputs) -> QueryPass | None:
        """The pass the runner runs before this step's forward (for the requests in
        ``SchedulerOutput.query_passes``), or None. The runner runs it through the model's
        layer loop (or a captured graph) with this connector's layer hooks."""
        return None

    def row_plan(self, inputs: ForwardInputs) -> RowPlan | None:
        """Rows each layer computes this step (after the query pass, if any); None = every row
        at every layer."""
        return None

    def needs_layer_hooks(self) -> bool:
        """Whether this step's forward must call the per-layer hooks. A step that needs none
        may run from a captured CUDA graph (no Python per layer). The default: connectors that
        override a hook always need them."""
        cls = type(self)
        return any(
            getattr(cls, name) is not getattr(KVConnectorBase, name)
            for name in ("wait_for_layer_load", "save_kv_layer")
        )

    def wait_for_save(self) -> None:
        """Block until this step's saves are handed off (the forward is done)."""


def load_stages(num_layers: int) -> list[tuple[int, int]]:
    """Layer ranges a connector's loads complete together on CUDA: 1, 2, 4, 8, ... layers. Each
    stage's copy is about as long as the compute of all the layers before it, so loading stays
    ahead of the forward, while a request costs ~log2(layers) launches per chunk, not one per
    layer (per-layer launches cost more host time than the copies they hid). A captured query
    pass is cut at the same layers (:mod:`blendkv.engine.query_pass_graphs`)."""
    stages, lo, size = [], 0, 1
    while lo < num_layers:
        stages.append((lo, min(lo + size, num_layers)))
        lo, size = lo + size, 2 * size
    return stages


def create_kv_connector(spec: Any, context: KVConnectorContext) -> KVConnectorBase:
    """``spec``: None (the do-nothing base connector), a registered name (``"blend"``), or a
    factory ``context -> connector``."""
    if spec is None:
        return KVConnectorBase(context)
    if isinstance(spec, str):
        target = KV_CONNECTORS.get(spec)
        if target is None:
            raise ConfigError(f"unknown kv_connector {spec!r}; registered: {sorted(KV_CONNECTORS)}")
        module, _, name = target.partition(":")
        spec = getattr(importlib.import_module(module), name)
    return spec(context)


# Registered connectors by name, imported on use (the engine depends on none of them).
KV_CONNECTORS = {"blend": "blendkv.connector.blend_connector:BlendConnector"}
