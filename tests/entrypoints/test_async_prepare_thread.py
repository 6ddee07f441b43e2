"""``AsyncLLM`` prepares requests (prompt factory, tokenising, validation, ``check``) on its
prepare thread: a request that is slow to prepare never stops the engine's steps, and one that
a check refuses is never queued."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from blendkv import SamplingParams
from blendkv.entrypoints.async_llm import AsyncLLM
from blendkv.errors import InvalidRequestError

ENGINE = dict(dtype="float32", block_size=4, max_model_len=256)
STREAM = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), **ENGINE)
    yield engine
    engine.shutdown()


def test_a_slow_prepare_does_not_stop_the_steps(engine):
    threads: list[str] = []
    release = threading.Event()

    def slow_prompt(stream) -> str:  # stands for a huge prompt being tokenised
        threads.append(threading.current_thread().name)
        assert release.wait(60)
        return "Paris is"

    async def main() -> tuple[int, int]:
        stream = await engine.add_request("The quick brown fox", STREAM)
        await stream.__anext__()
        pending = asyncio.ensure_future(
            engine.add_request(slow_prompt, SamplingParams(max_tokens=2))
        )
        got = 0
        async for _ in stream:  # the stream keeps getting tokens meanwhile
            got += 1
            if got == 20:
                break
        steps_while_preparing = engine.stats.num_steps
        release.set()
        slow = await asyncio.wait_for(pending, 60)
        answer = [out async for out in slow]
        stream.close()
        return got, steps_while_preparing, len(answer)

    steps_before = engine.stats.num_steps
    got, steps, answered = asyncio.run(main())
    assert threads == ["blendkv-prepare_0"]
    assert got == 20 and steps - steps_before >= 20 and answered == 2


def test_a_refused_check_queues_nothing(engine):
    def refuse(prepared) -> None:
        assert prepared.prompt_token_ids  # tokenised before the check
        raise InvalidRequestError("over the limit")

    async def main() -> None:
        with pytest.raises(InvalidRequestError, match="over the limit"):
            await engine.add_request("Paris is", SamplingParams(max_tokens=2), check=refuse)

    deadline = time.monotonic() + 30  # the earlier test's stream abort may still be queued
    while engine.stats.num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    aborted = engine.stats.num_aborted
    asyncio.run(main())
    stats = engine.stats
    assert engine.num_waiting == 0 and stats.num_running == 0
    assert stats.num_aborted == aborted  # nothing was queued, so nothing was aborted
