"""LLM.generate greedy outputs equal transformers' greedy outputs, token for token (fp32).

Also under a KV pool small enough to preempt, forced chunked prefill, and prefix-cache hits.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from helpers import QuietLLM, hf_greedy, needs_cpp_compiler

from blendkv import SamplingParams

MAX_TOKENS = 12


def prompts_of_mixed_lengths(seed=0, n=6, vocab=320):
    rng = random.Random(seed)
    lengths = [3, 17, 40, 9, 64, 25][:n]
    return [[rng.randrange(2, vocab) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_refs(request):
    path = request.getfixturevalue(f"tiny_{request.param}_dir")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = prompts_of_mixed_lengths()
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return path, prompts, refs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

ENGINE_SETUPS = {
    "default": dict(),
    "preemption": dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=64),
    "chunked": dict(max_num_batched_tokens=16, block_size=4),
    "no-prefix-cache": dict(enable_prefix_caching=False, block_size=8),
    # decode rows through the C++ kernel, next to prefill chunks in the same steps
    "cpu-kernels": dict(attention_backend="cpu", max_num_batched_tokens=16, block_size=4),
    # the plain-torch reference attention
    "torch-reference": dict(attention_backend="torch", max_num_batched_tokens=16, block_size=4),
}


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(s, marks=needs_cpp_compiler) if s == "cpu-kernels" else s
        for s in sorted(ENGINE_SETUPS)
    ],
)
def test_batch_matches_transformers(model_and_refs, setup):
    path, prompts, refs = model_and_refs
    llm = QuietLLM(str(path), dtype="float32", **ENGINE_SETUPS[setup])
    outs = llm.generate(prompts, GREEDY)
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
    if setup == "cpu-kernels":
        assert llm.engine.attn_backend.decode_kernel is not None
    preemptions = sum(o.metrics.num_preemptions for o in outs)
    if setup == "preemption":
        assert preemptions > 0, "the pool is meant to be too small for all six at once"
    else:
        assert preemptions == 0
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.info.num_kv_blocks


def test_prefix_cache_hits_keep_outputs_exact(model_and_refs):
    path, prompts, refs = model_and_refs
    llm = QuietLLM(str(path), dtype="float32", block_size=4)
    first = llm.generate(prompts, GREEDY)
    assert all(o.metrics.num_cached_tokens == 0 for o in first)
    again = llm.generate(prompts, GREEDY)  # same prompts: every full block but the last hits
    for out, ref, prompt in zip(again, refs, prompts, strict=True):
        assert out.outputs[0].token_ids == ref
        assert out.metrics.num_cached_tokens == (len(prompt) - 1) // 4 * 4
    # A new prompt sharing a 40-token prefix with prompt 2, different tail.
    shared = prompts[2] + [5, 6, 7, 8, 9]
    out = llm.generate([shared], GREEDY)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert out.metrics.num_cached_tokens == 40
    assert out.outputs[0].token_ids == hf_greedy(hf, shared, MAX_TOKENS)
    llm.engine.check_integrity()


def test_prompt_logits_are_computed_past_a_prefix_cache_hit(model_and_refs):
    """``logits_from`` caps the prefix-cache match: every asked-for row is computed, and equals
    the cold request's (the warm prefix holds the same K/V)."""
    path, prompts, _ = model_and_refs
    llm = QuietLLM(str(path), dtype="float32", block_size=4)
    prompt, start = prompts[4], 30  # 64 tokens; rows from 30 on
    params = SamplingParams(temperature=0.0, max_tokens=1)
    cold = llm.generate([prompt], params, logits_from=start)[0]
    warm = llm.generate([prompt], params, logits_from=start)[0]
    assert cold.metrics.num_cached_tokens == 0
    assert warm.metrics.num_cached_tokens == 28  # full blocks before position 30 only
    rows_cold, rows_warm = cold.extra["prompt_logits"], warm.extra["prompt_logits"]
    assert rows_warm.shape == rows_cold.shape == (len(prompt) - start, rows_cold.shape[1])
    torch.testing.assert_close(rows_warm, rows_cold, rtol=1e-4, atol=1e-4)


def test_streaming_deltas_concatenate_to_final_text(tiny_llama_dir):
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32")
    prompt = "The quick brown fox"
    final = llm.generate([prompt], GREEDY)[0]
    deltas = [o.delta_text for o in llm.stream(prompt, GREEDY)]
    assert "".join(deltas) == final.text
    assert len(deltas) == MAX_TOKENS
