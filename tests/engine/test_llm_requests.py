"""Bad input gets a typed error and the engine keeps serving; sampling features end to end."""

from __future__ import annotations

import random

import pytest
from helpers import QuietLLM

from blendkv import (
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelLoadError,
    PromptTooLongError,
    SamplingParams,
)
from blendkv.errors import ConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return QuietLLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, block_size=4)


def test_bad_requests_raise_and_engine_keeps_serving(llm):
    good = [5, 6, 7, 8]
    expected = llm.generate([good], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(PromptTooLongError, match="64"):
        llm.generate([good, [3] * 64], GREEDY)
    with pytest.raises(EmptyPromptError):
        llm.generate([""], GREEDY)
    with pytest.raises(EmptyPromptError):
        llm.generate([[]], GREEDY)
    with pytest.raises(InvalidSamplingParamsError, match="temperature"):
        llm.generate([good], SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidSamplingParamsError):
        llm.generate([good], {"temperature": 0})
    with pytest.raises(InvalidRequestError, match="out of range"):
        llm.generate([[1, 2, 100000]], GREEDY)
    with pytest.raises(InvalidRequestError):
        llm.generate([good, good], [GREEDY])
    # Nothing from the failed batches was queued; the engine still answers exactly.
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([good], GREEDY)[0].outputs[0].token_ids == expected
    llm.engine.check_integrity()


def test_unknown_model_and_bad_config():
    with pytest.raises(ModelLoadError, match="not a local file"):
        QuietLLM("/nonexistent/model-dir")
    with pytest.raises(ConfigError, match="dtype"):
        QuietLLM(None, dtype="int8")
    with pytest.raises(ConfigError, match="block_size"):
        QuietLLM(None, block_size=0)


def test_output_capped_by_max_model_len(llm):
    out = llm.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert out[0].outputs[0].finish_reason == "length"


def test_stop_token_ids_and_strings(llm):
    base = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    ids = base[0].outputs[0].token_ids
    stop_id = ids[3]
    first = ids.index(stop_id)
    out = llm.generate(
        [[5, 6, 7]],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True),
    )[0]
    assert out.outputs[0].token_ids == ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    text = base[0].text
    if len(text) > 4:
        stop = text[2:4]
        out = llm.generate(
            [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, stop=[stop], ignore_eos=True)
        )[0]
        assert out.text == text[: text.index(stop)]
        assert out.outputs[0].stop_reason == stop


def test_seeded_sampling_reproducible_in_any_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=8, ignore_eos=True)
    alone = llm.generate([[9, 10, 11]], params)[0].outputs[0].token_ids
    crowd = llm.generate([[4, 4], [9, 10, 11], [7] * 20], [GREEDY, params, GREEDY])
    assert crowd[1].outputs[0].token_ids == alone


def test_logprobs_returned(llm):
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 3
    for token, entry in zip(out.outputs[0].token_ids, lps, strict=True):
        assert next(iter(entry)) == token and entry[token] <= 0.0


def test_stream_abort_frees_blocks(llm):
    stream = llm.stream([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    next(stream)
    stream.close()  # abandons the request
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.info.num_kv_blocks


def test_random_engine_workload_integrity(tiny_llama_dir):
    """Arrivals, aborts and preemption through the real engine; integrity after every step."""
    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=20,
        block_size=4,
        max_num_seqs=5,
        max_num_batched_tokens=24,
    )
    engine = llm.engine
    rng = random.Random(7)
    finished, preemptions, live = 0, 0, []
    for _i in range(120):
        if rng.random() < 0.35:
            n = rng.randrange(1, 30)
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(1, 10), ignore_eos=True
            )
            live.append(engine.add_request([rng.randrange(2, 300) for _ in range(n)], params))
        if rng.random() < 0.05 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished:
                finished += 1
                preemptions += out.metrics.num_preemptions
                live.remove(out.request_id)
        engine.check_integrity()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
        engine.check_integrity()
    assert finished > 10 and preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.info.num_kv_blocks


def test_engine_stats_count_requests_and_blocks(llm):
    engine = llm.engine
    assert engine.stats().num_running == engine.stats().num_kv_blocks_used == 0
    ids = [engine.add_request([5, 6, 7, 8, 9] * 3, SamplingParams(max_tokens=3)) for _ in range(2)]
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 2 and stats.num_waiting == 0
    assert stats.last_step_num_scheduled == 2 and stats.num_kv_blocks_used > 0
    assert stats.num_kv_blocks == engine.info.num_kv_blocks
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats()
    assert after.num_running == 0 and after.num_kv_blocks_used == 0
    assert all(i not in engine.requests for i in ids)
