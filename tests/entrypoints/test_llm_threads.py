"""One ``LLM`` (and the ``RAGPipeline`` over it) shared by threads: ``generate``, ``stream`` and
``rag.query`` called at once from 8 threads are batched in one engine loop, and each caller gets
exactly its sequential (greedy) answer; a bad request fails in its own thread only."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Paged attention stores", "Paris is the capital of", "One two"]
DOCS = [
    "Octopuses have three hearts and blue blood; two hearts pump blood to the gills.",
    "The Eiffel Tower was finished in 1889 and is made of wrought iron.",
    "Honeybees tell each other where flowers are with a waggle dance.",
]
QUESTIONS = ["How many hearts does an octopus have?", "When was the Eiffel Tower finished?"]


@pytest.fixture(scope="module")
def rag(tiny_llama_dir, tmp_path_factory):
    from blendkv.rag import RAGPipeline

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4, enable_prefix_caching=False)
    rag = RAGPipeline(tmp_path_factory.mktemp("threads") / "store", llm=llm, chunk_tokens=16)
    rag.ingest(DOCS, progress=False)
    yield rag
    rag.close()
    llm.close()


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def jobs(rag) -> list[Callable[[], object]]:
    """8 calls: 3 generate (one of 2 prompts), 3 stream (consumed token by token), 2 rag.query."""
    llm = rag.llm

    def generate(prompts):
        return lambda: [tokens(o) for o in llm.generate(prompts, GREEDY)]

    def stream(prompt):
        def run():
            outs = list(llm.stream(prompt, GREEDY))
            assert outs[-1].finished and len(outs) == GREEDY.max_tokens
            return tokens(outs[-1]), "".join(o.delta_text for o in outs)

        return run

    def query(question):
        return lambda: rag.query(question, k=2, sampling_params=GREEDY).answer

    return [
        generate(PROMPTS[0]),
        generate(PROMPTS[1:3]),
        generate(PROMPTS[3]),
        stream(PROMPTS[0]),
        stream(PROMPTS[2]),
        stream(PROMPTS[3]),
        query(QUESTIONS[0]),
        query(QUESTIONS[1]),
    ]


def run_at_once(calls: list[Callable[[], object]]) -> list[object]:
    """Run every call on its own thread, all released together; results (or errors) in order."""
    barrier = threading.Barrier(len(calls))
    results: list[object] = [None] * len(calls)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except BaseException as e:  # reported by the test, not lost in the thread
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung"
    return results


def test_eight_threads_each_get_their_sequential_answer(rag):
    expected = [call() for call in jobs(rag)]
    for _ in range(3):  # several rounds: thread start order (and so batch make-up) varies
        got = run_at_once(jobs(rag))
        for exp, out in zip(expected, got, strict=True):
            if isinstance(out, BaseException):
                raise out
            assert out == exp
    assert not rag.llm.engine.has_unfinished_requests()


def test_a_bad_request_fails_in_its_own_thread_only(rag):
    llm = rag.llm
    expected = [tokens(o) for o in llm.generate(PROMPTS, GREEDY)]
    calls = [lambda p=p: tokens(llm.generate(p, GREEDY)[0]) for p in PROMPTS]
    calls.insert(2, lambda: llm.generate([PROMPTS[0], [10**9]], GREEDY))  # not a token id
    calls.insert(4, lambda: list(llm.stream("", GREEDY)))
    got = run_at_once(calls)
    assert isinstance(got.pop(4), InvalidRequestError)
    assert isinstance(got.pop(2), InvalidRequestError)
    assert got == expected
    assert not llm.engine.has_unfinished_requests()


def test_closing_a_stream_on_another_thread_leaves_the_others_running(rag):
    llm = rag.llm
    expected = [tokens(o) for o in llm.generate(PROMPTS[:2], GREEDY)]

    def abandon():
        stream = llm.stream(PROMPTS[3], GREEDY)
        next(stream)
        stream.close()  # aborts its request mid-flight
        return None

    got = run_at_once(
        [lambda: tokens(llm.generate(PROMPTS[0], GREEDY)[0]), abandon]
        + [lambda: tokens(list(llm.stream(PROMPTS[1], GREEDY))[-1])]
    )
    assert got == [expected[0], None, expected[1]]
    assert not llm.engine.has_unfinished_requests()


def test_ingest_beside_queries_and_generate(rag):
    """An ingest (chunk K/V computed through the same model) runs while other threads query and
    generate; everyone's answer is the sequential one and the store stays consistent."""
    llm = rag.llm
    new_docs = [f"Document {i}: the lighthouse keeper counted {i} ships at dawn." for i in range(6)]
    expected = [
        rag.query(QUESTIONS[0], k=1, sampling_params=GREEDY).answer,
        tokens(llm.generate(PROMPTS[1], GREEDY)[0]),
    ]
    calls = [
        lambda: rag.ingest(new_docs, progress=False).added,
        lambda: rag.query(QUESTIONS[0], k=1, sampling_params=GREEDY).answer,
        lambda: tokens(llm.generate(PROMPTS[1], GREEDY)[0]),
    ]
    got = run_at_once(calls)
    for out in got:
        if isinstance(out, BaseException):
            raise out
    assert len(got[0]) == len(new_docs)
    assert got[1:] == expected
    assert rag.verify().ok
