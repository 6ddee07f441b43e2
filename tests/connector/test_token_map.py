"""The engine fills the token map only when a request asks for it, and it agrees with the blend
stats: across selections, corrections, ratios, a prefix-cache hit and a blend run as full
prefill."""

from __future__ import annotations

import pytest
from helpers import BLEND_DOCS, BLEND_QUERY, QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.errors import InvalidRequestError

PROMPT = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
GREEDY = SamplingParams(max_tokens=2, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        kv_store_dir=str(tmp_path_factory.mktemp("store")),
    )
    yield llm
    llm.close()


def check(stats, num_prompt_tokens: int):
    tm = stats.token_map
    counts = tm.counts()
    assert len(tm.kinds) == num_prompt_tokens == stats.num_prompt_tokens
    assert counts["recomputed"] == stats.reused_tokens_recomputed
    assert counts["reused"] + counts["corrected"] == stats.reused_tokens_kept
    assert counts["computed"] == stats.other_tokens_computed
    assert counts["prefix_cached"] == stats.prefix_cached_tokens
    return tm


@pytest.mark.parametrize(
    "config",
    [
        None,  # the default target: uncalibrated, ProphetKV at 0.3, K correction
        BlendConfig(selection="v_deviation", recompute_ratio=0.3),
        BlendConfig(selection="k_deviation", recompute_ratio=0.2, correction="none"),
        BlendConfig(selection="v_deviation", recompute_ratio=0.2, reselect=1, chunk_head_tokens=2),
        BlendConfig(recompute_ratio=0.0),
        BlendConfig(recompute_ratio=1.0),
    ],
    ids=["default", "v_deviation", "no_correction", "reselect", "reuse", "full"],
)
def test_counts_match_the_blend_stats(llm, config):
    out = llm.generate([PROMPT], GREEDY, blend=config, token_map=True)[0]
    tm = check(out.blend_stats, len(out.prompt_token_ids))
    cfg = out.blend_stats.config  # what ran (a target's: the ratio the engine picked)
    assert not cfg.target_mode
    counts = tm.counts()
    chunk_tokens = sum(e - s for s, e in tm.chunk_spans)
    assert out.blend_stats.tokens_reused == chunk_tokens
    if cfg.recompute_ratio == 1.0:
        assert counts["recomputed"] == chunk_tokens
    if cfg.recompute_ratio == 0.0 or cfg.correction == "none":
        assert counts["corrected"] == 0
    if 0 < cfg.recompute_ratio < 1:
        assert counts["recomputed"] > 0 and tm.selections
        first = min(cfg.selection_layers(3))
        assert tm.selections[0] == (first, cfg.score_at(first))
        scored = [i for i, s in enumerate(tm.scores) if s is not None or tm.forced[i]]
        assert set(scored) <= {i for i, c in enumerate(tm.chunks) if c >= 0}
    prophet = cfg.selection == "prophet" and 0 < cfg.recompute_ratio < 1
    assert (tm.query_mass is not None) == prophet
    # every chunk token of a kept row says where it left the recompute set
    for i, kind in enumerate(tm.kinds):
        assert (tm.dropped_at[i] >= 0) == (kind in "sc")


def test_a_normal_request_records_nothing(llm):
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.blend_stats is not None and out.blend_stats.token_map is None
    assert "token_map" not in out.blend_stats.to_dict()
    with pytest.raises(InvalidRequestError, match="token_map needs a blended prompt"):
        llm.generate(["a plain prompt"], GREEDY, token_map=True)


def test_prefix_cache_and_full_prefill(tiny_llama_dir, tmp_path):
    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=True,
        kv_store_dir=str(tmp_path / "store"),
    )
    try:
        first = llm.generate([PROMPT], GREEDY, token_map=True)[0]
        again = llm.generate([PROMPT], GREEDY, token_map=True)[0]  # the same blend, cached
        tm = check(again.blend_stats, len(again.prompt_token_ids))
        assert tm.counts()["prefix_cached"] > 0
        assert tm.kinds.startswith("p" * tm.counts()["prefix_cached"])
        assert first.blend_stats.token_map.counts()["prefix_cached"] == 0
        # The engine's cost check runs this blend as full prefill: every token computed.
        llm.engine.kv_connector.blend_refused = "a test says so"
        refused = llm.generate([PROMPT], GREEDY, token_map=True)[0]
        tm = check(refused.blend_stats, len(refused.prompt_token_ids))
        assert set(tm.kinds) <= {"p", "n"} and refused.blend_stats.fallback == "a test says so"
    finally:
        llm.close()
