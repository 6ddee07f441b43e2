"""Blend or full prefill: a blended request that left its :class:`BlendConfig` to the engine runs
whichever this engine predicts is cheaper, from what it measured.

Blending only pays when loading stored K/V and recomputing a few rows costs less than computing
every row: on a tiny model, a short prompt, a slow storage tier, or a device where ProphetKV's
query pass dominates, it may not. The prediction, in seconds (tensor-free, scheduler side)::

    full    = N x L / full_rate            every prompt row through every layer
    blend   = compute + max(0, load - hidden)
    compute = row_layers(config) / blend_rate
    load    = sum over tiers of (reused tokens' K/V bytes read from it) / bandwidth[tier]
    hidden  = compute when chunk K/V is written layer by layer behind the forward, else 0

``N`` prompt tokens, ``L`` layers. ``row_layers`` counts the layers before the first selection
with every row, the repaired and always-computed rows after it, the dropped rows' Q/K/V at a
selection layer, and ProphetKV's first pass (the non-reused rows through every layer; those
before the first chunk it settles, and they leave the fused forward) -- the
unit :class:`~blendkv.blend.row_plan.BlendRowPlan` reports. The rates are the
:class:`~blendkv.loading.controller.LoadingController`'s moving averages: row-layers per second of
fused prefills and of plain prefill steps, bytes per second per tier.

The choice, in order: the default config if it is predicted cheaper than full prefill; else,
for a two-pass (ProphetKV) default, the one-pass selection :data:`CHEAPER_SELECTION` if that is;
else full prefill of the same tokens (``blend_stats.fallback`` says why). No choice is made --
the request blends as configured -- when it passed its own ``BlendConfig`` (quality is the
user's call), the check is off, a rate it needs is not measured yet, or a chunk is not stored
yet (computing and storing it is what later requests reuse).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from blendkv.blend.config import BlendConfig
from blendkv.errors import ConfigError
from blendkv.loading.controller import LoadingController

__all__ = [
    "CHEAPER_SELECTION",
    "CostChoice",
    "ModelCosts",
    "RequestShape",
    "apply_choice",
    "blend_row_layers",
    "choose",
    "qkv_share",
    "request_shape",
]

# The one-pass fallback of a ProphetKV default: CacheBlend's V-deviation pick at its published
# ratio (blendkv's default before ProphetKV), keeping the default's other fields (K correction).
CHEAPER_SELECTION = {"selection": "v_deviation", "recompute_ratio": 0.15}


@dataclass(frozen=True)
class CostChoice:
    """What the check decided for one request (``BlendStats.cost_choice`` / ``cost_reason``)."""

    choice: str  # "blend", "cheaper_selection", "full_prefill"; "" when no choice was made
    config: BlendConfig | None  # the config to blend with; None: full prefill
    reason: str


@dataclass(frozen=True)
class RequestShape:
    """One blended request, in tokens: its prompt, its stored chunk tokens by the tier they are
    read from, its chunk tokens not stored yet, and its tokens before the first chunk."""

    num_prompt_tokens: int
    reused_by_tier: dict[str, int]
    missing_tokens: int = 0
    lead_tokens: int = 0

    @property
    def reused_tokens(self) -> int:
        return sum(self.reused_by_tier.values())


@dataclass(frozen=True)
class ModelCosts:
    """Facts of the model the prediction needs."""

    num_layers: int
    token_layer_bytes: int  # K + V of one token at one layer, as written into the pool
    qkv_share: float  # share of a layer's per-row matmul work spent on the Q/K/V projections


def request_shape(state, manager, controller: LoadingController, device_tier=None) -> RequestShape:
    """The :class:`RequestShape` of a prepared request (``BlendRequestState``): each chunk is
    read from where the loader would read it (the loader's ``device_tier``: "device"; writer's
    pending set or memory tier: "memory"; else the store's tier, or the better measured of the
    two)."""
    store = manager.store
    by_tier: dict[str, int] = {}
    missing = 0
    seen: set[bytes] = set()
    for key, chunk in zip(state.chunk_keys, state.prompt.chunks, strict=True):
        if device_tier is not None and key in device_tier:
            tier = "device"
        elif key in seen:  # computed once, then found
            tier = "memory"
        elif manager.pending(key) is not None:
            tier = "memory"
        elif key in store.memory_tier:
            tier = controller.choose_tier(["memory", store.tier])
        elif key in store:
            tier = store.tier
        else:
            tier = None
        seen.add(key)
        if tier is None:
            missing += len(chunk)
        else:
            by_tier[tier] = by_tier.get(tier, 0) + len(chunk)
    starts = state.prompt.chunk_starts
    lead = starts[0] if starts else len(state.prompt.token_ids)
    return RequestShape(len(state.prompt.token_ids), by_tier, missing, lead)


def blend_row_layers(
    config: BlendConfig, num_layers: int, reused: int, other: int, qkv_share: float, lead: int = 0
) -> float:
    """Row-layers of a fused prefill of ``reused`` chunk tokens and ``other`` always-computed
    tokens, ``lead`` of them before the first chunk, as
    :class:`~blendkv.blend.row_plan.BlendRowPlan` counts them (selection passes included; the
    lead rows ProphetKV's pass computed leave at the first selection)."""
    selections = config.selection_layers(num_layers)
    prophet = config.selection == "prophet" and 0.0 < config.planned_ratio < 1.0 and reused > 0
    cost = float(other * num_layers) if prophet else 0.0  # ProphetKV's query pass
    always = other - lead if prophet else other
    count, prev = reused + other, 0
    for layer in sorted(selections):
        kept = always + round(selections[layer] * reused)
        # At layer 0 a full-reuse or ProphetKV pick uses stored K/V: no fresh Q/K/V there.
        projected = not (layer == 0 and (config.full_reuse or config.selection == "prophet"))
        dropped = (count - kept) * qkv_share if projected else 0.0
        cost += count * (layer - prev) + kept + dropped
        prev, count = layer + 1, kept
    return cost + count * (num_layers - prev)


def predict_blend_seconds(
    controller: LoadingController,
    config: BlendConfig,
    shape: RequestShape,
    model: ModelCosts,
    overlapped: bool,
) -> float | None:
    """Predicted seconds of the fused prefill (None: a rate it needs is not measured)."""
    rate = controller.compute.value
    if rate is None:
        return None
    reused = shape.reused_tokens
    other = shape.num_prompt_tokens - reused
    row_layers = blend_row_layers(
        config, model.num_layers, reused, other, model.qkv_share, shape.lead_tokens
    )
    compute = row_layers / rate
    loaded_layers = model.num_layers - config.first_partial_layer
    load = 0.0
    for tier, tokens in shape.reused_by_tier.items():
        bandwidth = controller.bandwidth.get(tier)
        if bandwidth is None or bandwidth.value is None:
            return None
        load += tokens * loaded_layers * model.token_layer_bytes / bandwidth.value
    hidden = compute if overlapped else 0.0
    return compute + max(0.0, load - hidden)


def predict_full_seconds(
    controller: LoadingController, shape: RequestShape, model: ModelCosts
) -> float | None:
    """Predicted seconds of full prefill of the prompt (None: not measured yet)."""
    rate = controller.full_compute.value
    if rate is None:
        return None
    return shape.num_prompt_tokens * model.num_layers / rate


def choose(
    controller: LoadingController,
    config: BlendConfig,
    shape: RequestShape,
    model: ModelCosts,
    overlapped: bool,
) -> CostChoice:
    """Blend with ``config`` (the engine's default, its target resolved to a ratio), with
    :data:`CHEAPER_SELECTION`, or full prefill: the first of these predicted cheaper than full
    prefill, else full prefill."""
    assert not config.target_mode, "the cost check needs the ratio a target resolved to"
    if shape.missing_tokens:
        return CostChoice("", config, "chunks not stored yet: blending stores them for later")
    if shape.reused_tokens == 0:
        return CostChoice("", config, "no stored chunk tokens: nothing to predict")
    full = predict_full_seconds(controller, shape, model)
    blend = predict_blend_seconds(controller, config, shape, model, overlapped)
    if full is None or blend is None:
        return CostChoice("", config, "not measured yet: blending as configured")
    if blend < full:
        return CostChoice("blend", config, _says("blend", blend, full, config))
    cheaper = _cheaper(config, model.num_layers)
    if cheaper is not None:
        seconds = predict_blend_seconds(controller, cheaper, shape, model, overlapped)
        if seconds is not None and seconds < full:
            why = _says("cheaper selection", seconds, full, cheaper) + (
                f" (default {_ms(blend)} ms)"
            )
            return CostChoice("cheaper_selection", cheaper, why)
    return CostChoice(
        "full_prefill",
        None,
        f"cost check: full prefill predicted {_ms(full)} ms <= blend "
        f"{_ms(blend)} ms ({_name(config)}); ran full prefill",
    )


def apply_choice(
    state,
    manager,
    controller: LoadingController,
    model: ModelCosts,
    overlapped: bool,
    device_tier=None,
):
    """``state`` (a ``BlendRequestState`` on the engine's default config) with :func:`choose`'s
    choice in its stats, and its config (and prefix-cache salt) the cheaper one when chosen.
    The caller runs a ``full_prefill`` choice as full prefill."""
    shape = request_shape(state, manager, controller, device_tier)
    choice = choose(controller, state.config, shape, model, overlapped)
    if choice.config is not None and choice.config is not state.config:
        state = manager.reconfigure(state, choice.config)
    state.stats.cost_choice, state.stats.cost_reason = choice.choice, choice.reason
    return state


def _cheaper(config: BlendConfig, num_layers: int) -> BlendConfig | None:
    """The one-pass alternative of a two-pass default (None: none, or it does not fit)."""
    if config.selection != "prophet":
        return None
    try:
        cheaper = dataclasses.replace(config, **CHEAPER_SELECTION)
        cheaper.validate_for(num_layers)
    except ConfigError:  # e.g. a one-layer model has no check layer
        return None
    return cheaper


def _says(what: str, blend: float, full: float, config: BlendConfig) -> str:
    return (
        f"cost check: {what} predicted {_ms(blend)} ms < full prefill {_ms(full)} ms "
        f"({_name(config)})"
    )


def _name(config: BlendConfig) -> str:
    return f"{config.selection}@{config.recompute_ratio}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def qkv_share(model) -> float:
    """Share of a decoder layer's matmul FLOPs per row spent on the Q/K/V projections."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
    o = c.num_attention_heads * head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return qkv / (qkv + o + mlp)
