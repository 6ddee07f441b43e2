"""Blending against its oracles (fp32): full prefill at ratio 1.0, an independent
transformers reference at ratio 0.0, and a causal-mask construction."""

from __future__ import annotations

import torch
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import reference_full_reuse_logits

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = {"documents": DOCS, "query": QUERY}


def test_ratio_one_equals_full_prefill(blend_llm):
    state = blend_llm.blend_manager().prepare(PROMPT, BlendConfig(recompute_ratio=1.0))
    start = state.prompt.query_start
    blended = blend_llm.generate(
        [PROMPT], GREEDY, blend=BlendConfig(recompute_ratio=1.0), logits_from=start
    )[0]
    full = blend_llm.generate([state.prompt.token_ids], GREEDY, logits_from=start)[0]
    a, b = blended.extra["prompt_logits"], full.extra["prompt_logits"]
    assert a.shape == b.shape == (len(state.prompt.token_ids) - start, a.shape[1])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert blended.outputs[0].token_ids == full.outputs[0].token_ids
    stats = blended.blend_stats
    assert stats.tokens_reused == state.prompt.num_chunk_tokens
    assert stats.recompute_fraction == 1.0


def test_ratio_zero_equals_independent_reference(blend_llm, hf_model):
    manager = blend_llm.blend_manager()
    config = BlendConfig(recompute_ratio=0.0)
    state = manager.prepare(PROMPT, config)
    out = blend_llm.generate([PROMPT], GREEDY, blend=config, logits_from=state.prompt.query_start)[
        0
    ]
    ref = reference_full_reuse_logits(hf_model, manager, state)
    torch.testing.assert_close(out.extra["prompt_logits"], ref, atol=1e-4, rtol=0)
    assert out.blend_stats.reused_tokens_recomputed == 0
    # and it is not the same as full prefill (the check would be vacuous otherwise)
    full = blend_llm.generate(
        [state.prompt.token_ids], GREEDY, logits_from=state.prompt.query_start
    )[0]
    assert (full.extra["prompt_logits"] - ref).abs().max() > 1e-2


def fused_kv_after_prefill(llm, prompt, config):
    """Run only the fused prefill step and read the request's K/V back from its blocks."""
    engine = llm.engine
    blended = llm.blend_manager().prepare(prompt, config).prompt
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4), blend=config)
    seq = engine.requests[rid].seq
    engine.step()
    n = seq.num_prompt_tokens
    table = torch.tensor(seq.block_table)
    bs = engine.config.cache.block_size
    slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    kv = torch.stack([c.view(2, -1, *c.shape[-2:])[:, slots] for c in engine.runner.kv_caches])
    engine.abort_request(rid)
    return kv, blended


def test_recomputed_context_rows_never_see_later_tokens(blend_llm):
    """Same documents, two different queries: with an exact per-row causal mask the fused K/V
    of every chunk position is identical; a bottom-right-aligned mask would let recomputed
    chunk rows attend to the (different) query and change."""
    # V deviation: ProphetKV's pick depends on the query by design, so the rows would differ.
    config = BlendConfig(recompute_ratio=0.5, selection="v_deviation")
    kv_a, p = fused_kv_after_prefill(blend_llm, PROMPT, config)
    kv_b, q = fused_kv_after_prefill(
        blend_llm, {"documents": DOCS, "query": "Tell me about dogs and foxes, please."}, config
    )
    end = p.query_start
    assert p.query_start == q.query_start
    # Equal up to fp32 rounding: the CPU attention splits a sequence's rows into groups by
    # their positions (runs of consecutive ones apart), and the two queries' rows shift those
    # groups, so the log-sum-exp merges round differently (~1e-6).
    torch.testing.assert_close(kv_a[..., :end, :, :], kv_b[..., :end, :, :], atol=1e-5, rtol=0)
    # Sanity: the queries' own rows differ by far more, so the comparison above could fail.
    query_diff = (kv_a[..., end : end + 3, :, :] - kv_b[..., end : end + 3, :, :]).abs().max()
    assert query_diff > 1e-2


def test_gradual_filtering_schedule(blend_llm):
    config = BlendConfig(recompute_ratio=0.5, check_layer=1, schedule=((2, 0.2),))
    out = blend_llm.generate([PROMPT], GREEDY, blend=config)[0]
    stats = out.blend_stats
    assert abs(stats.recompute_fraction - 0.2) < 0.02
    assert stats.tokens_recomputed == stats.reused_tokens_recomputed + (
        len(out.prompt_token_ids) - stats.tokens_reused
    )
