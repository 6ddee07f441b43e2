"""The KV connector: how an engine extension brings K/V from outside (and saves it).

Shaped like vLLM v1's ``KVConnectorBase_V1``: one object with a scheduler side and a worker side.
The engine sees only this interface; blending (``blendkv.connector.blend_connector``) is one
implementation, a test's dict-backed connector another. Configured with
``EngineConfig(kv_connector=...)``.

    request in ──prepare_prompt / add_request──▶ connector keeps per-request state
    scheduler ──get_precompute_work────────▶ side work first (document chunks), as prefill
              ──kv_ready───────────────────▶ False: its K/V is still being read (it may wait)
              ──get_num_new_matched_tokens──▶ tokens whose K/V comes from outside (skipped)
              ──fused_prefill_cost─────────▶ prefills that must run whole, and their cost
              ──update_state_after_alloc───▶ blocks are allocated: remember what to load
              ──build_connector_meta───────▶ KVConnectorMetadata, carried on SchedulerOutput
    runner    ──run_precompute (the step's side work, before the batch)
    runner    ──bind_connector_metadata, start_load_kv (K/V into the request's blocks)
              ──row_plan──────────────────▶ rows each layer computes (None = all)
    forward   ──wait_for_layer_load(l) / save_kv_layer(l)   (LayerHooks, per layer)
    runner    ──wait_for_save, clear_connector_metadata
    engine    ──request_stats (into RequestOutput.blend_stats), request_finished

Scheduler-side methods are pure Python (ids and ints); tensors appear only on the worker side.
"""

from __future__ import annotations

import importlib
from abc import ABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blendkv.errors import ConfigError, InvalidRequestError
from blendkv.models.hooks import LayerHooks

if TYPE_CHECKING:
    import torch

    from blendkv.config import EngineConfig
    from blendkv.engine.scheduler_output import PrecomputeWork, SchedulerOutput
    from blendkv.engine.sequence import Sequence
    from blendkv.kernels.attention import AttentionBackend, AttentionMetadata
    from blendkv.models.hooks import RowPlan
    from blendkv.models.pieces import Pieces


class KVConnectorMetadata:
    """What the scheduler side tells the worker side about one step (subclassed)."""


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector is built from (facts of the running engine)."""

    config: EngineConfig
    model: Any  # the causal LM (torch module)
    tokenizer: Any
    attn_backend: AttentionBackend
    info: Any  # RuntimeInfo
    resolved: Any  # the resolved model (paths, for fingerprints)


@dataclass
class ConnectorPrompt:
    """A prompt the connector parsed: its token ids, the salt mixed into its prefix-cache block
    hashes, the connector's own per-request payload (handed back by ``add_request``), and the
    first position whose prompt logits exist (rows before it may skip the last layers)."""

    token_ids: list[int]
    cache_salt: bytes = b""
    kv_transfer_params: Any = None
    min_logits_position: int = 0


@dataclass
class ForwardInputs:
    """The step's tensors, as the worker side sees them."""

    input_ids: torch.Tensor
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    pieces: Pieces | None = None  # how the forward runs its dense pieces (None: eagerly)
    # the connector's own graphs (KVConnectorBase.make_graphs; None: its passes run eagerly)
    query_graphs: Any = None


class KVConnectorBase(LayerHooks, ABC):
    """Base class. Every method has a do-nothing default (dict prompts are refused), so the
    base class itself is the engine's connector when ``EngineConfig.kv_connector`` is None."""

    def __init__(self, context: KVConnectorContext) -> None:
        self.context = context
        self._metadata: KVConnectorMetadata | None = None

    # ---- requests (engine) --------------------------------------------------------------
    def prepare_prompt(self, prompt: dict, options: Any) -> ConnectorPrompt:
        """Parse a dict prompt (raise a typed error on bad input). Default: not supported."""
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
    def get_precompute_work(self, seq: Sequence) -> list[tuple[int, int]]:
        """Work the connector must run before ``seq`` can be admitted, not yet done: (item
        index, token cost) pairs, each one forward (a document chunk whose K/V is not stored).
        The scheduler spreads them over steps under its token budget and holds ``seq``
        (no blocks) until this is empty. Pure ints; called again after every step."""
        return []

    def get_background_work(self) -> list[tuple[str, int]]:
        """Low-priority work (a blend audit's full prefill): (work id, token cost) pairs the
        scheduler hands out as precompute items only in a step where no request waits or
        runs; run by :meth:`run_precompute`."""
        return []

    def has_background_work(self) -> bool:
        return False

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
    ) -> int | None:
        """None for an ordinary (chunkable) prefill. An int: the ``num_new_tokens`` must be
        scheduled in one step, and cost this many tokens of the step's budget."""
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

    def run_precompute(self, work: list[PrecomputeWork]) -> None:
        """Run the step's precompute items (from :meth:`get_precompute_work`), before the
        batch's forward; a finished item is no longer returned by ``get_precompute_work``."""

    def start_load_kv(self, inputs: ForwardInputs) -> None:
        """Start bringing this step's external K/V into the blocks (before the forward)."""

    def row_plan(self, inputs: ForwardInputs) -> RowPlan | None:
        """Rows each layer computes this step; None = every row at every layer."""
        return None

    def make_graphs(self, kv_caches: list, block_size: int, max_rows: int) -> Any:
        """Captured graphs of passes of the connector's own (ProphetKV's query pass), handed
        back by every step as ``ForwardInputs.query_graphs``; the engine asks on CUDA with
        graphs on. None (here): it has none."""
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
