"""``AsyncLLM``: concurrent asyncio requests share the continuous batch, each gets exactly its
offline greedy answer; closing a stream aborts its request; ``max_waiting`` refuses more."""

from __future__ import annotations

import asyncio

import pytest
from helpers import QuietLLM

from blendkv import InvalidSamplingParamsError, PromptTooLongError, SamplingParams
from blendkv.entrypoints.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [
    f"Paged attention {i} stores keys" if i % 2 else f"The quick brown fox {i}" for i in range(8)
]
ENGINE = dict(dtype="float32", block_size=4, max_model_len=128)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    llm = QuietLLM(str(tiny_llama_dir), **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), **ENGINE)
    yield engine
    engine.shutdown()


def all_blocks_free(engine: AsyncLLM) -> bool:
    bm = engine.llm.engine.block_manager
    return engine.stats.num_kv_blocks_used == 0 and bm.num_free_blocks == bm.num_blocks


async def collect(engine: AsyncLLM, prompt: str, params=GREEDY) -> list:
    return [out async for out in engine.generate(prompt, params)]


def test_concurrent_requests_batch_together_and_match_offline(engine, offline):
    async def main():
        return await asyncio.wait_for(
            asyncio.gather(*(collect(engine, p) for p in PROMPTS)), timeout=60
        )

    steps_before = engine.stats.num_steps
    results = asyncio.run(main())
    for prompt, outs in zip(PROMPTS, results, strict=True):
        assert len(outs) == GREEDY.max_tokens and outs[-1].finished
        assert outs[-1].outputs[0].token_ids == offline[prompt]
        assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert engine.stats.max_step_requests > 1  # requests shared steps
    # Batched: far fewer steps than 8 requests x 10 tokens one after another.
    assert engine.stats.num_steps - steps_before < len(PROMPTS) * GREEDY.max_tokens
    assert all_blocks_free(engine)


def test_bad_request_raises_and_others_are_unaffected(engine, offline):
    async def main():
        good = asyncio.create_task(collect(engine, PROMPTS[0]))
        with pytest.raises(InvalidSamplingParamsError):
            await engine.add_request(PROMPTS[1], SamplingParams(temperature=-1))
        with pytest.raises(PromptTooLongError):
            await engine.add_request("fox " * 200, GREEDY)
        with pytest.raises(ZeroDivisionError):  # a failing prompt factory reaches the caller
            await engine.add_request(lambda stream: 1 / 0, GREEDY)
        return await asyncio.wait_for(good, timeout=60)

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].token_ids == offline[PROMPTS[0]]
    assert all_blocks_free(engine)


def test_closing_a_stream_aborts_its_request(engine):
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        aborted = engine.stats.num_aborted
        stream = await engine.add_request(PROMPTS[0], long)
        first = await stream.__anext__()
        assert not first.finished
        stream.close()
        for _ in range(200):  # bounded: the abort runs on the engine thread
            if engine.stats.num_aborted > aborted and all_blocks_free(engine):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
    assert not engine.llm.engine.has_unfinished_requests()


def test_max_waiting_refuses_with_overloaded(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), max_waiting=1, max_num_seqs=1, **ENGINE)
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def main():
        running = await engine.add_request(PROMPTS[0], long)
        await running.__anext__()  # admitted: the only batch slot is taken
        waiting = await engine.add_request(PROMPTS[1], GREEDY)
        assert engine.num_waiting == 1
        with pytest.raises(EngineOverloadedError, match="max_waiting=1"):
            await engine.add_request(PROMPTS[2], GREEDY)
        running.close()  # frees the slot: the waiting request runs to the end
        outs = [o async for o in waiting]
        assert outs[-1].finished
        again = await engine.add_request(PROMPTS[2], GREEDY)  # accepted now
        return [o async for o in again]

    try:
        outs = asyncio.run(asyncio.wait_for(main(), timeout=60))
        assert outs[-1].finished
    finally:
        engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.add_request(PROMPTS[0], GREEDY))
