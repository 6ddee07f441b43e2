"""``SamplingParams.prompt_logprobs`` against transformers' logits on a tiny model: fresh, from
a prefix-cached prompt (recomputed), and with n > 1; blended prompts refuse it."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.errors import InvalidSamplingParamsError

PROMPT = "Paged attention stores keys and values in fixed-size blocks of tokens."


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return QuietLLM(str(tiny_llama_dir), device="cpu", dtype="float32", enable_prefix_caching=True)


def _reference(model_dir, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].log_softmax(-1)


def _check(entries, ids, ref, k):
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry = entries[i]
        assert entry[ids[i]] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top = ref[i - 1].topk(k)
        assert set(top.indices.tolist()) <= set(entry)
        assert len(entry) in (k, k + 1)
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[t] == pytest.approx(v, abs=1e-4)


def test_prompt_logprobs_match_transformers_cached_or_not(llm, tiny_llama_dir):
    ids = llm.tokenizer.encode(PROMPT)
    assert len(ids) > 16  # spans more than one KV block: the second run has a cached prefix
    ref = _reference(tiny_llama_dir, ids)
    plain = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None
    for _ in range(2):  # the second request's prompt blocks are in the prefix cache
        out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
        _check(out[0].prompt_logprobs, ids, ref, 3)
        assert out[0].metrics.num_cached_tokens == 0  # recomputed, never read from the cache
    n2 = SamplingParams(max_tokens=2, temperature=1.0, seed=1, n=2, prompt_logprobs=0)
    out = llm.generate([ids], n2)[0]
    assert len(out.outputs) == 2
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    assert out.prompt_logprobs[5][ids[5]] == pytest.approx(ref[4, ids[5]].item(), abs=1e-4)


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(InvalidSamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidSamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
