"""``LLM.stream`` routes outputs: interleaved streams (and a ``generate`` between two stream
items) each get all of their own tokens, equal to ``generate``'s greedy answers."""

from __future__ import annotations

import pytest
from helpers import QuietLLM

from blendkv import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Paged attention stores", "Paris is the capital of"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4)


def drain(stream) -> tuple[list[int], str, list]:
    outs = list(stream)
    return outs[-1].outputs[0].token_ids, "".join(o.delta_text for o in outs), outs


def test_two_interleaved_streams_each_match_generate(llm):
    expected = llm.generate(PROMPTS[:2], GREEDY)
    a, b = llm.stream(PROMPTS[0], GREEDY), llm.stream(PROMPTS[1], GREEDY)
    got: dict[str, list] = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:  # strictly alternate: each next() steps the engine for both requests
        for name in list(live):
            out = next(live[name], None)
            if out is None:
                del live[name]
            else:
                got[name].append(out)
    for name, exp in zip("ab", expected, strict=True):
        outs = got[name]
        assert len(outs) == GREEDY.max_tokens  # one output per token, none dropped
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].token_ids == exp.outputs[0].token_ids
        assert "".join(o.delta_text for o in outs) == exp.text
    assert llm.engine.block_manager.num_free_blocks == llm.engine.info.num_kv_blocks


def test_generate_between_stream_items_keeps_the_stream_whole(llm):
    [exp0, exp2] = llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY)
    stream = llm.stream(PROMPTS[0], GREEDY)
    first = next(stream)
    [mid] = llm.generate([PROMPTS[2]], GREEDY)  # steps the engine while the stream is open
    rest = list(stream)
    outs = [first, *rest]
    assert mid.outputs[0].token_ids == exp2.outputs[0].token_ids
    assert outs[-1].outputs[0].token_ids == exp0.outputs[0].token_ids
    assert "".join(o.delta_text for o in outs) == exp0.text
    assert len(outs) == GREEDY.max_tokens


def test_closing_one_stream_aborts_only_it(llm):
    [exp] = llm.generate([PROMPTS[1]], GREEDY)
    a, b = llm.stream(PROMPTS[0], GREEDY), llm.stream(PROMPTS[1], GREEDY)
    next(a), next(b)
    a.close()  # aborts request a; b keeps its outputs
    tokens, text, _ = drain(b)
    assert tokens == exp.outputs[0].token_ids and text == exp.text
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.info.num_kv_blocks
