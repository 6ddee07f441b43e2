"""A blend that never loses to full prefill: a blended request that left its
``BlendConfig`` to the engine runs the cheaper of blend and full prefill, predicted from the
loading controller's measurements (``blendkv.guards.cost_check``). Measurements are injected:
no test here depends on timing."""

from __future__ import annotations

import pytest
from helpers import BLEND_DOCS, BLEND_QUERY, blend_llm

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.config import GuardConfig
from blendkv.entrypoints.openai.protocol import ChatCompletionRequest
from blendkv.entrypoints.openai.serving import blend_config
from blendkv.errors import ConfigError
from blendkv.guards.cost_check import (
    ModelCosts,
    RequestShape,
    blend_row_layers,
    choose,
)
from blendkv.loading.controller import LoadingController

PROMPT = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
TIERS = ("memory", "lmdb")


def _measured(controller: LoadingController, blend_rate, full_rate, bandwidth) -> None:
    """Inject rates: row-layers/s of fused and of plain prefills, bytes/s of every tier."""
    controller.compute.value = blend_rate
    controller.full_compute.value = full_rate
    for tier in TIERS:
        controller.record_load(tier, 1, 1.0)
        controller.bandwidth[tier].value = bandwidth


# ---- the prediction alone (pure Python) -----------------------------------------------------
MODEL = ModelCosts(num_layers=30, token_layer_bytes=4096, qkv_share=0.2)
# What the check sees of a request that set no config: the default target, resolved to a ratio
# (the engine's pick from the store's calibration) before the check runs.
RESOLVED = BlendConfig(recompute_ratio=0.1)
SHAPE = RequestShape(num_prompt_tokens=1500, reused_by_tier={"lmdb": 1000})


def test_nothing_measured_blends_as_configured():
    config = RESOLVED
    choice = choose(LoadingController(), config, SHAPE, MODEL, overlapped=True)
    assert choice.choice == "" and choice.config is config and "not measured" in choice.reason


def test_slow_compute_blends():
    c = LoadingController()
    _measured(c, blend_rate=1e4, full_rate=1e4, bandwidth=1e12)
    choice = choose(c, RESOLVED, SHAPE, MODEL, overlapped=True)
    assert choice.choice == "blend" and choice.config == RESOLVED


def test_fast_compute_and_a_slow_tier_run_full_prefill():
    c = LoadingController()
    _measured(c, blend_rate=1e9, full_rate=1e9, bandwidth=1e6)
    tiny = RequestShape(num_prompt_tokens=40, reused_by_tier={"lmdb": 30})
    choice = choose(c, RESOLVED, tiny, MODEL, overlapped=True)
    assert choice.choice == "full_prefill" and choice.config is None
    assert "full prefill predicted" in choice.reason


def test_a_dominant_query_pass_picks_the_one_pass_selection():
    # ProphetKV's pass over 500 other rows costs more than it saves here; V deviation does not.
    shape = RequestShape(num_prompt_tokens=1500, reused_by_tier={"lmdb": 1000})
    c = LoadingController()
    _measured(c, blend_rate=6e5, full_rate=1e6, bandwidth=1e12)
    choice = choose(c, RESOLVED, shape, MODEL, overlapped=True)
    assert choice.choice == "cheaper_selection"
    assert choice.config.selection == "v_deviation" and choice.config.recompute_ratio == 0.15
    assert choice.config.correction == RESOLVED.correction  # the rest stays the default


def test_unstored_chunks_blend_and_are_stored():
    c = LoadingController()
    _measured(c, blend_rate=1e9, full_rate=1e9, bandwidth=1e6)
    cold = RequestShape(num_prompt_tokens=40, reused_by_tier={}, missing_tokens=30)
    assert choose(c, RESOLVED, cold, MODEL, overlapped=True).choice == ""


def test_loading_hides_behind_compute_only_when_pipelined():
    c = LoadingController()
    # Load ~ compute: pipelined, the load hides and blending wins; serial, they add up.
    _measured(c, blend_rate=1e6, full_rate=1e6, bandwidth=1000 * 30 * 4096 / 0.02)
    assert choose(c, RESOLVED, SHAPE, MODEL, overlapped=True).choice == "blend"
    assert choose(c, RESOLVED, SHAPE, MODEL, overlapped=False).choice != "blend"


def test_switch(tiny_llama_dir, tmp_path):
    with blend_llm(tiny_llama_dir, tmp_path, None) as llm:
        assert llm.config.guards.blend_cost_check is False  # the tests' QUIET default
        assert llm.engine.kv_connector.cost_check is False
    assert GuardConfig().blend_cost_check is True  # a user's engine checks
    with pytest.raises(ConfigError, match="blend_cost_check must be True or False"):
        GuardConfig(blend_cost_check="yes")


def test_the_server_tells_a_requests_own_config_from_none():
    msgs = [{"role": "user", "content": "q"}]
    assert blend_config(ChatCompletionRequest(messages=msgs, documents=[{"text": "d"}])) is None
    own = ChatCompletionRequest(messages=msgs, blend={"recompute_ratio": 0.3})
    assert blend_config(own) == BlendConfig(recompute_ratio=0.3)


# ---- in the engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("never-loses-store")
    llm = blend_llm(tiny_llama_dir, store, None, blend_cost_check=True)
    llm.generate(PROMPT, GREEDY)  # stores the chunks (no rates are injected yet)
    llm.blend_manager().flush()
    yield llm
    llm.close()


def test_the_engine_measures_both_rates(llm):
    controller = llm.engine.kv_connector.controller
    assert controller.compute.value is not None  # the fused prefill above
    ids = llm.generate(PROMPT, GREEDY)[0].prompt_token_ids
    controller.full_compute.value = None
    llm.generate([ids], GREEDY)  # a plain prefill
    assert controller.full_compute.value is not None


def test_steps_that_capture_graphs_teach_no_rate(llm):
    """A step that captured CUDA graphs took the capture's time too: neither rate learns from
    it (one slow first blend would make the check run full prefill, which never measures the
    blend again). The next step at the same sizes replays, and is measured."""
    from blendkv.engine.cuda_graphs import EagerCapture
    from blendkv.engine.piecewise_graphs import PiecewiseGraphs

    runner = llm.engine.runner
    controller = llm.engine.kv_connector.controller
    ids = llm.generate(PROMPT, GREEDY)[0].prompt_token_ids
    runner.piece_graphs = graphs = PiecewiseGraphs("cpu", capture=EagerCapture())
    try:
        for generate in (lambda: llm.generate(PROMPT, GREEDY), lambda: llm.generate([ids], GREEDY)):
            controller.compute.value = controller.full_compute.value = None
            captures = graphs.captures
            generate()  # the prefill captures its pieces
            assert graphs.captures > captures
            assert controller.compute.value is None and controller.full_compute.value is None
            captures = graphs.captures
            generate()
            assert graphs.captures == captures  # replayed only
            assert (controller.compute.value, controller.full_compute.value) != (None, None)
    finally:
        runner.piece_graphs = None


def test_slow_compute_blends_in_the_engine(llm):
    _measured(llm.engine.kv_connector.controller, blend_rate=1e3, full_rate=1e3, bandwidth=1e12)
    stats = llm.generate(PROMPT, GREEDY)[0].blend_stats
    assert stats.cost_choice == "blend" and "blend predicted" in stats.cost_reason
    assert stats.tokens_reused > 0 and not hasattr(stats, "fallback")


def test_fast_compute_runs_full_prefill_and_says_why(llm):
    _measured(llm.engine.kv_connector.controller, blend_rate=1e9, full_rate=1e9, bandwidth=1e3)
    out = llm.generate(PROMPT, GREEDY)[0]
    stats = out.blend_stats
    assert stats.cost_choice == "full_prefill"
    assert stats.fallback == stats.cost_reason and "full prefill predicted" in stats.fallback
    assert stats.to_dict()["cost_choice"] == "full_prefill"
    assert stats.tokens_reused == 0 and stats.chunks_hit == 0
    full = llm.generate([out.prompt_token_ids], GREEDY)[0]  # plain prefill of the same tokens
    assert out.outputs[0].token_ids == full.outputs[0].token_ids


@pytest.mark.parametrize(
    "config", [BlendConfig(), BlendConfig(selection="v_deviation", recompute_ratio=0.4)]
)
def test_a_requests_own_config_is_never_overridden(llm, config):
    _measured(llm.engine.kv_connector.controller, blend_rate=1e9, full_rate=1e9, bandwidth=1e3)
    stats = llm.generate(PROMPT, GREEDY, blend=config)[0].blend_stats
    assert stats.cost_choice == "" and "own BlendConfig" in stats.cost_reason
    assert stats.tokens_reused > 0 and not hasattr(stats, "fallback")
    ran = stats.config  # a target's: the ratio the engine picked for it
    assert ran == config or (config.target_mode and not ran.target_mode)
    assert stats.reused_tokens_recomputed == round(ran.recompute_ratio * stats.tokens_reused)


def test_off_switch_blends_as_configured(tiny_llama_dir, tmp_path):
    with blend_llm(tiny_llama_dir, tmp_path, None, blend_cost_check=False) as llm:
        llm.generate(PROMPT, GREEDY)  # stores the chunks
        _measured(llm.engine.kv_connector.controller, blend_rate=1e9, full_rate=1e9, bandwidth=1e3)
        stats = llm.generate(PROMPT, GREEDY)[0].blend_stats
    assert stats.cost_choice == "" and stats.tokens_reused > 0


@pytest.mark.parametrize(
    "config",
    [
        BlendConfig(),
        BlendConfig(selection="v_deviation", recompute_ratio=0.4),
        BlendConfig(reselect=1),
    ],
)
def test_predicted_row_layers_are_what_the_fused_prefill_counts(llm, config):
    """The prediction's unit is the row plan's: its count for a config is the plan's."""
    from blendkv.guards.cost_check import qkv_share as _qkv_share

    stats = llm.generate(PROMPT, GREEDY, blend=config)[0].blend_stats
    model = llm.engine.kv_connector.context.model
    layers = model.config.num_hidden_layers
    other = stats.num_prompt_tokens - stats.tokens_reused
    lead = llm.blend_manager().prepare(PROMPT, config).prompt.chunk_starts[0]
    assert lead > 0  # the template's head: ProphetKV's pass settles it
    predicted = blend_row_layers(
        stats.config, layers, stats.tokens_reused, other, _qkv_share(model), lead
    )
    assert predicted == pytest.approx(stats.row_layers, rel=1e-9)
