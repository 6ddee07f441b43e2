"""``BlendConfig.skip_exact``: a chunk stored behind exactly the prompt's tokens before it (the
first chunk, when the anchor is the prompt's own prefix) already holds full prefill's K/V, so
the recompute budget goes to the other chunks. Oracle: full prefill (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.errors import ConfigError

ONE = SamplingParams(temperature=0.0, max_tokens=1)
PROMPT = {"documents": DOCS, "query": QUERY}


def _ratio_for_all_but_first(state) -> float:
    """The smallest ratio whose budget covers every reused row outside the first chunk."""
    total = state.prompt.num_chunk_tokens
    first = len(state.prompt.chunks[0])
    return math.ceil((total - first) / total * 1000) / 1000


def _logits(llm, prompt, config, start):
    return llm.generate([prompt], ONE, blend=config, logits_from=start)[0]


@pytest.mark.parametrize("selection", ["prophet", "random"])
def test_budget_skips_the_exact_first_chunk(blend_llm, selection):
    """The anchor is the prompt's prefix (no system, no instruction): at a ratio that covers
    every other chunk's rows, the blend recomputes exactly those and equals full prefill;
    picking from every chunk (``skip_exact=False``) leaves some of them stale."""
    manager = blend_llm.blend_manager()
    state = manager.prepare(PROMPT, BlendConfig())
    prompt = state.prompt
    assert prompt.token_ids[: prompt.chunk_starts[0]] == manager.anchor_ids
    ratio = _ratio_for_all_but_first(state)
    start = prompt.query_start
    full = blend_llm.generate([prompt.token_ids], ONE, logits_from=start)[0]

    config = BlendConfig(recompute_ratio=ratio, selection=selection)
    out = _logits(blend_llm, PROMPT, config, start)
    stats = out.blend_stats
    assert stats.reused_tokens_recomputed == prompt.num_chunk_tokens - len(prompt.chunks[0])
    torch.testing.assert_close(
        out.extra["prompt_logits"], full.extra["prompt_logits"], atol=1e-5, rtol=0
    )

    every = _logits(
        blend_llm,
        PROMPT,
        BlendConfig(recompute_ratio=ratio, selection=selection, skip_exact=False),
        start,
    )
    assert every.blend_stats.reused_tokens_recomputed == round(ratio * prompt.num_chunk_tokens)
    diff = (every.extra["prompt_logits"] - full.extra["prompt_logits"]).abs().max()
    assert diff > 1e-4  # some of the budget went to rows that were exact already


def test_no_exact_chunk_behind_another_prefix(blend_llm):
    """An instruction the anchor does not hold: the first chunk was stored behind other tokens,
    so it is not exact and the whole budget is spent over every chunk."""
    prompt = {**PROMPT, "instruction": "Answer in one word.\n"}
    state = blend_llm.blend_manager().prepare(prompt, BlendConfig())
    ratio = _ratio_for_all_but_first(state)
    out = _logits(blend_llm, prompt, BlendConfig(recompute_ratio=ratio), state.prompt.query_start)
    assert out.blend_stats.reused_tokens_recomputed == round(ratio * state.prompt.num_chunk_tokens)


def test_lossy_codec_is_never_exact(tiny_llama_dir):
    """int8-stored K/V differs from what full prefill computes: its rows stay candidates."""
    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        kv_codec="int8",
    )
    try:
        state = llm.blend_manager().prepare(PROMPT, BlendConfig())
        ratio = _ratio_for_all_but_first(state)
        config = BlendConfig(recompute_ratio=ratio)
        out = _logits(llm, PROMPT, config, state.prompt.query_start)
        total = state.prompt.num_chunk_tokens
        assert out.blend_stats.reused_tokens_recomputed == round(ratio * total)
    finally:
        llm.close()


def test_skip_exact_keys_the_prefix_cache():
    assert BlendConfig().cache_key() != BlendConfig(skip_exact=False).cache_key()
    plain = BlendConfig(selection="v_deviation", correction="none")
    assert (
        plain.cache_key()
        != BlendConfig(selection="v_deviation", correction="none", skip_exact=False).cache_key()
    )
    with pytest.raises(ConfigError, match="skip_exact"):
        BlendConfig(skip_exact=1)
