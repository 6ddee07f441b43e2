"""The blend start gate: at engine start, a blend that recomputes every token must be full
prefill, or the engine refuses to blend and serves full prefill.

A fused prefill at ``recompute_ratio=1.0`` recomputes every reused row at every layer, so its
answer is full prefill's whatever the stored K/V holds. When it is not, the model's blend path
is broken (an architecture detail the fused forward misses, a broken correction or kernel), and
every blend of that model would answer garbage (LMCache users report that for models its
blending does not support). The gate runs one short canned blended prompt at R = 1.0 and
the same tokens as a plain prompt, and compares the greedy tokens and the last prompt row's
distribution (KL). On a mismatch the connector refuses to blend: every blended request runs
as full prefill of its tokens, and its ``blend_stats.fallback`` says why.

``GuardConfig.blend_start_gate``: True runs it whenever the blend connector is the engine's,
False never, None (the default) when blending is configured (a KV store or other connector
settings).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from blendkv.blend.stats import BlendStats
from blendkv.connector.request_state import BlendRequestState

__all__ = [
    "GATE_KL_TOLERANCE",
    "GateResult",
    "RefusedBlendState",
    "RefusedBlendStats",
    "gate_at_start",
    "gate_enabled",
    "refused_prompt",
    "run_start_gate",
]

logger = logging.getLogger(__name__)

GATE_REQUEST_ID = "blendkv-start-gate"
GATE_TOKENS = 4  # greedy tokens compared
# KL(full || blend@1.0) of the last prompt row, nats: rounding differences of the fused path
# (another reduction order, bf16) stay far below it; a broken path lands far above it.
GATE_KL_TOLERANCE = {"float32": 1e-4}
GATE_KL_TOLERANCE_LOW_PRECISION = 2e-2
GATE_DOCUMENTS = (
    "The lighthouse on Carrow Point was built in 1871 and is painted in red and white bands. "
    "Its lamp is maintained by the harbour trust, which also runs the small museum beside it.",
    "Visitors reach the point by a coastal path from the village of Ellsby. The walk takes "
    "about forty minutes, and the museum opens every day except Monday from April to October.",
)
GATE_QUERY = "Question: Which village does the path to the lighthouse start from? Answer:"


@dataclass(frozen=True)
class GateResult:
    """What the gate compared, and whether blending is allowed."""

    passed: bool
    reason: str  # why it failed ("" when it passed)
    kl: float  # KL(full || blend) of the last prompt row, nats
    full_tokens: tuple[int, ...]
    blend_tokens: tuple[int, ...]


def gate_enabled(setting: bool | None, blending_configured: bool) -> bool:
    """``setting`` if given; else on when blending is configured."""
    if setting is not None:
        return bool(setting)
    return blending_configured


def gate_at_start(engine) -> GateResult | None:
    """Run the gate on a new ``engine`` when its blend connector's settings ask for it (see
    :func:`gate_enabled`; blending counts as configured when connector settings were given)."""
    conn = engine.kv_connector
    if not _is_blend_connector(conn):
        return None
    configured = engine.config.kv_connector_config is not None
    if not gate_enabled(engine.config.guards.blend_start_gate, configured):
        return None
    return run_start_gate(engine)


def run_start_gate(engine) -> GateResult | None:
    """Compare blend@1.0 with full prefill on the canned prompt on the idle ``engine``; on a
    mismatch the blend connector refuses every later blend (``connector.blend_refused``).
    Returns None when the engine's connector is not the blend connector."""
    from blendkv.blend.config import BlendConfig
    from blendkv.entrypoints.warmup import _fresh_block_pool
    from blendkv.errors import PromptTooLongError
    from blendkv.guards.fidelity import kl_divergence
    from blendkv.sampling_params import SamplingParams

    conn = engine.kv_connector
    if not _is_blend_connector(conn):
        return None
    assert not engine.has_unfinished_requests(), "gate an idle engine"
    conn.blend_refused = None
    prompt = {"documents": list(GATE_DOCUMENTS), "query": GATE_QUERY}
    params = SamplingParams(max_tokens=GATE_TOKENS, temperature=0.0, ignore_eos=True)
    config = BlendConfig(recompute_ratio=1.0)
    try:
        num_ids = len(engine.prepare_request(prompt, params, blend=config).prompt_token_ids)
    except PromptTooLongError:
        num_ids = engine.info.max_model_len
    if num_ids + GATE_TOKENS > engine.info.max_model_len:
        logger.info("start gate skipped: its prompt does not fit max_model_len")
        return None
    try:
        blend = _run(engine, prompt, params, config)
    except Exception as e:  # noqa: BLE001  (a blend path that crashes is refused, not fatal)
        engine.abort_request(f"{GATE_REQUEST_ID}-blend")
        _fresh_block_pool(engine)
        return _refuse(engine, conn, [f"it raised {type(e).__name__}: {e}"], float("nan"), (), ())
    full = _run(engine, blend.prompt_token_ids, params, None)
    _fresh_block_pool(engine)  # no cached prefix of the gate's prompt stays
    kl = float(kl_divergence(full.extra["prompt_logits"][-1], blend.extra["prompt_logits"][-1]))
    full_tokens = tuple(full.outputs[0].token_ids)
    blend_tokens = tuple(blend.outputs[0].token_ids)
    tolerance = GATE_KL_TOLERANCE.get(engine.info.dtype, GATE_KL_TOLERANCE_LOW_PRECISION)
    reasons = []
    if not kl <= tolerance:  # also NaN
        reasons.append(f"KL {kl:.3g} nats > {tolerance:g}")
    # Rounding may flip a later near-tie at low precision: there the first token must agree.
    compared = len(full_tokens) if engine.info.dtype == "float32" else 1
    if full_tokens[:compared] != blend_tokens[:compared]:
        reasons.append(f"greedy tokens {list(blend_tokens)} != full prefill's {list(full_tokens)}")
    return _refuse(engine, conn, reasons, kl, full_tokens, blend_tokens)


def _refuse(engine, conn, reasons: list[str], kl: float, full_tokens, blend_tokens) -> GateResult:
    """The gate's result; with ``reasons``, blending is refused and the reason logged."""
    if not reasons:
        return GateResult(True, "", kl, full_tokens, blend_tokens)
    reason = (
        f"start gate: blend at ratio 1.0 of {engine.info.model_name} ({engine.info.architecture}) "
        f"differs from full prefill ({'; '.join(reasons)}); blending is off, every request runs "
        "full prefill"
    )
    conn.blend_refused = reason
    logger.warning("%s", reason)
    return GateResult(False, reason, kl, tuple(full_tokens), tuple(blend_tokens))


def _is_blend_connector(conn) -> bool:
    """The blend connector (it has ``blend_refused``), told apart without importing it: the
    connector imports this module. ``manager`` is looked up on the class: the instance's
    property opens the store, which must not happen before the gate is wanted."""
    return hasattr(conn, "blend_refused") and hasattr(type(conn), "manager")


def _run(engine, prompt, params, blend):
    ids = engine.prepare_request(prompt, params, blend=blend).prompt_token_ids
    request_id = f"{GATE_REQUEST_ID}-{'blend' if blend is not None else 'full'}"
    engine.add_request(prompt, params, request_id=request_id, blend=blend, logits_from=len(ids) - 1)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    assert final is not None, "the gate's request did not finish"
    return final


@dataclass
class RefusedBlendStats(BlendStats):
    """A refused blend's stats: nothing reused, and why (``fallback``, also in ``to_dict``)."""

    fallback: str = ""


@dataclass
class RefusedBlendState(BlendRequestState):
    """A blended request on an engine that refuses to blend: no chunk is loaded, none is
    missing, the prompt's tokens run as an ordinary prefill."""

    def needs_fusion(self, num_computed_tokens: int) -> bool:
        return False


def refused_prompt(state: BlendRequestState, reason: str):
    """The :class:`ConnectorPrompt` of ``state``'s tokens as plain full prefill, its stats
    saying why (``fallback``)."""
    from blendkv.engine.kv_connector import ConnectorPrompt

    fields = {f: getattr(state, f) for f in ("prompt", "config", "salt", "token_map")}
    fields["stats"] = RefusedBlendStats(**asdict(state.stats), fallback=reason)
    refused = RefusedBlendState(chunk_keys=[], **fields)
    return ConnectorPrompt(list(state.prompt.token_ids), kv_transfer_params=refused)
