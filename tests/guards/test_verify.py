"""A check on demand (``verify=True``): a blended answer against full prefill of the same
prompt tokens: both greedy answers, the largest and mean next-token KL along full prefill's."""

from __future__ import annotations

import pytest
from helpers import BLEND_DOCS, BLEND_QUERY, QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig

PROMPT = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4) as llm:
        yield llm


def test_ratio_one_verifies_as_full_prefill(llm):
    out = llm.generate([PROMPT], PARAMS, blend=BlendConfig(recompute_ratio=1.0), verify=True)[0]
    v = out.blend_stats.verification
    full = llm.generate([out.prompt_token_ids], PARAMS)[0]
    assert v.same_answer and v.full_answer == full.text.strip()
    assert v.max_kl < 1e-4 and v.top1_agreement == 1.0 and v.scored_tokens == 6
    assert out.blend_stats.to_dict()["verification"]["same_answer"] is True
    assert "same answer as full prefill" in v.describe()


def test_full_reuse_differs_measurably(llm):
    out = llm.generate([PROMPT], PARAMS, blend=BlendConfig(recompute_ratio=0.0), verify=True)[0]
    v = out.blend_stats.verification
    assert v.max_kl > 1e-4 and v.max_kl >= v.mean_kl >= 0.0 and v.first_token_kl <= v.max_kl
    blend = llm.generate([PROMPT], PARAMS, blend=BlendConfig(recompute_ratio=0.0))[0]
    assert v.blend_answer == blend.text.strip()
    full = llm.generate([out.prompt_token_ids], PARAMS)[0]
    assert v.same_answer == (blend.outputs[0].token_ids == full.outputs[0].token_ids)


def test_plain_prompts_are_not_verified(llm):
    out = llm.generate(["The capital of France is"], PARAMS, verify=True)[0]
    assert out.blend_stats is None


def test_the_blend_that_ran_is_the_one_checked(llm):
    """``blend_stats.config`` is the config the request blended with (here its own; else a
    fidelity target's ratio or the cost check's cheaper selection): the check re-runs that one,
    not the engine's default, whatever the caller says it asked for."""
    from blendkv.guards.verify import verify

    reuse = BlendConfig(recompute_ratio=0.0)
    out = llm.generate([PROMPT], PARAMS, blend=reuse)[0]
    assert out.blend_stats.config == reuse and "config" not in out.blend_stats.to_dict()
    asked = out.blend_stats.verification = verify(llm, PROMPT, out, reuse, 6)
    unsaid = verify(llm, PROMPT, out, None, 6)  # as a caller that left the config to the engine
    default = llm.generate([PROMPT], PARAMS, blend=BlendConfig(recompute_ratio=0.5))[0]
    assert unsaid.max_kl == asked.max_kl and unsaid.blend_answer == asked.blend_answer
    assert verify(llm, PROMPT, default, None, 6).max_kl < asked.max_kl
