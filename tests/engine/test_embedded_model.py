"""The embedded SmolLM2-135M-Instruct through the whole engine equals transformers (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import hf_greedy

from blendkv import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three uses of a paperclip, one per line, with a short explanation of each.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", block_size=16)


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
