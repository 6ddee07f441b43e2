"""Blend stats whose parts add up to the prompt, on real blended requests (tiny model): every
prompt token's K/V came from exactly one of prefix cache / reused as stored / reused and
repaired / computed, also when the prefix cache serves part or all of the prompt."""

from __future__ import annotations

import re

import pytest
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=BLOCK) as llm:
        yield llm


def check_parts(out) -> None:
    st, n = out.blend_stats, len(out.prompt_token_ids)
    assert st.num_prompt_tokens == n
    assert st.reused_tokens_kept == st.tokens_reused - st.reused_tokens_recomputed >= 0
    parts = (
        st.prefix_cached_tokens,
        st.reused_tokens_kept,
        st.reused_tokens_recomputed,
        st.other_tokens_computed,
    )
    assert min(parts) >= 0 and sum(parts) == n
    # The printed line states the same parts, and they add up.
    numbers = [int(x) for x in re.findall(r"\d+", st.describe())]
    assert numbers[0] == n and sum(numbers[1:]) == n
    d = st.to_dict()
    assert (d["num_prompt_tokens"], d["reused_tokens_kept"], d["other_tokens_computed"]) == (
        n,
        st.reused_tokens_kept,
        st.other_tokens_computed,
    )


@pytest.mark.parametrize("ratio", [0.0, 0.15, 0.5, 1.0])
def test_parts_add_up_with_and_without_the_prefix_cache(llm, ratio):
    blend = BlendConfig(recompute_ratio=ratio)
    # 1. Cold: no prefix-cache hit (each ratio is its own cache salt), one fused prefill.
    [cold] = llm.generate([{"documents": DOCS, "query": QUERY}], GREEDY, blend=blend)
    st, n = cold.blend_stats, len(cold.prompt_token_ids)
    assert st.prefix_cached_tokens == 0 and st.tokens_reused > 0
    assert st.tokens_reused - st.reused_tokens_recomputed + st.tokens_recomputed == n
    assert st.other_tokens_computed == st.tokens_recomputed - st.reused_tokens_recomputed
    check_parts(cold)

    # 2. Same documents, another query: the hit stops inside the last chunk, whose tail is
    #    fused against the cached blocks. The identity then counts the cached tokens too.
    [part] = llm.generate(
        [{"documents": DOCS, "query": "Where does the fox jump?"}], GREEDY, blend=blend
    )
    st, n = part.blend_stats, len(part.prompt_token_ids)
    state = llm.blend_manager().prepare({"documents": DOCS, "query": QUERY}, blend)
    query_start = state.prompt.query_start
    assert 0 < st.prefix_cached_tokens == part.metrics.num_cached_tokens < query_start
    assert st.tokens_reused == query_start - st.prefix_cached_tokens > 0
    assert (
        st.tokens_reused - st.reused_tokens_recomputed + st.tokens_recomputed
        == n - st.prefix_cached_tokens
    )
    check_parts(part)

    # 3. The cold prompt again: the cache serves every chunk token, no fused prefill runs and
    #    the rest is an ordinary prefill, counted as other tokens computed.
    [warm] = llm.generate([{"documents": DOCS, "query": QUERY}], GREEDY, blend=blend)
    st, n = warm.blend_stats, len(warm.prompt_token_ids)
    assert st.prefix_cached_tokens >= query_start
    assert st.tokens_reused == st.tokens_recomputed == 0
    assert st.other_tokens_computed == n - st.prefix_cached_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    check_parts(warm)
