"""The embedded SmolLM2-135M-Instruct through the whole engine equals transformers (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import QuietLLM, hf_greedy

from blendkv import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three uses of a paperclip, one per line, with a short explanation of each.",
]


@pytest.fixture(scope="module")
def llm():
    return QuietLLM(None, dtype="float32", block_size=16)


def test_chat_batch_matches_transformers_greedy(llm):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [llm.render_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        llm.engine.resolved.model_dir, dtype=torch.float32
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16)
    # All three were admitted in one step, before any block was cached.
    assert all(o.metrics.num_cached_tokens == 0 for o in outs)
    # A later request reuses the blocks of the shared system prompt.
    later = llm.render_chat([{"role": "user", "content": "Another question?"}])
    out = llm.generate([later], params)[0]
    common = next(i for i, (a, b) in enumerate(zip(later, prompts[0], strict=False)) if a != b)
    assert common >= 16 and out.metrics.num_cached_tokens == common // 16 * 16
    assert out.outputs[0].token_ids == hf_greedy(hf, later, 16)


def test_chat_stops_at_im_end(llm):
    out = llm.chat(
        [{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=64)
    )[0]
    assert out.outputs[0].finish_reason == "stop"
    assert "<|im_end|>" not in out.text and out.text.strip()


# Chat questions SmolLM2 answers in fewer than MIN_TOKENS tokens (greedy EOS at 2, 11 and 7
# tokens), and one it does not.
SHORT_ANSWERS = [
    "Say hello.",
    "Reply with one word: yes or no. Is water wet?",
    "What is 2+2?",
    "What is the capital of France?",
]
MIN_TOKENS = 12  # above the last early EOS (11)


def test_min_tokens_matches_transformers_min_new_tokens(llm):
    """EOS cannot be *generated* before min_tokens (vLLM, transformers' min_new_tokens)."""
    eos = list(llm.engine.info.eos_token_ids)
    prompts = [llm.render_chat([{"role": "user", "content": q}]) for q in SHORT_ANSWERS]
    # The test can fail: without min_tokens, greedy picks EOS early in some of these answers.
    free = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MIN_TOKENS, ignore_eos=True)
    )
    assert sum(any(t in eos for t in o.outputs[0].token_ids) for o in free) >= 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        llm.engine.resolved.model_dir, dtype=torch.float32
    )
    # transformers' greedy answer with EOS masked for MIN_TOKENS tokens, stopping at EOS after
    # them (at most twice as many); greedy, so its first MIN_TOKENS tokens are also the answer
    # capped there.
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            min_new_tokens=MIN_TOKENS,
            max_new_tokens=2 * MIN_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        refs.append(ref)
    # min_tokens == max_tokens (EOS never stops), then EOS may stop after min_tokens.
    for max_tokens, ignore_eos in ((MIN_TOKENS, True), (2 * MIN_TOKENS, False)):
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, min_tokens=MIN_TOKENS, ignore_eos=ignore_eos
        )
        outs = llm.generate(prompts, params)
        for prompt, out, ref in zip(prompts, outs, refs, strict=True):
            got = out.outputs[0].token_ids
            assert got == ref[:max_tokens], (prompt, max_tokens)
            assert not any(t in eos for t in got[:MIN_TOKENS])
