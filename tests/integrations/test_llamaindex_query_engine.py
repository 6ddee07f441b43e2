"""The LlamaIndex query engine answers as ``RAGPipeline.query`` does (greedy, the pipeline's
instruction, the retrieved chunks as source nodes), streamed or not, sync or async, and from
several threads or an ``asyncio.gather`` at once (tiny random Llama, float32)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import QuietLLM

pytest.importorskip("llama_index.core", reason="llama-index-core is not installed")

from llama_index.core.base.response.schema import (  # noqa: E402
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.schema import QueryBundle  # noqa: E402

from blendkv import SamplingParams  # noqa: E402
from blendkv.errors import InvalidRequestError  # noqa: E402
from blendkv.integrations.llamaindex import BlendKVQueryEngine  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
DOCS = [
    "Octopuses have three hearts and blue blood; two hearts pump blood to the gills.",
    "The Eiffel Tower was finished in 1889 and is made of wrought iron.",
    "Honeybees tell each other where flowers are with a waggle dance.",
    "Jupiter is the largest planet in the Solar System, a gas giant.",
]
QUESTIONS = [
    "How many hearts does an octopus have?",
    "When was the Eiffel Tower finished?",
    "How do bees find flowers?",
    "Which planet is the largest?",
]


@pytest.fixture(scope="module")
def rag(tiny_llama_dir, tmp_path_factory):
    from blendkv.rag import RAGPipeline

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    rag = RAGPipeline(tmp_path_factory.mktemp("li-engine") / "store", llm=llm, chunk_tokens=16)
    rag.ingest(DOCS, progress=False)
    yield rag
    rag.close()
    llm.close()


@pytest.fixture(scope="module")
def expected(rag) -> dict[str, object]:
    """Each question's answer from the pipeline itself, one at a time."""
    return {q: rag.query(q, k=2, sampling_params=GREEDY) for q in QUESTIONS}


def chunk_ids(nodes) -> list[int]:
    return [n.node.metadata["chunk_id"] for n in nodes]


def test_query_is_the_pipelines_answer_with_its_sources(rag, expected):
    engine = BlendKVQueryEngine(rag, similarity_top_k=2, sampling_params=GREEDY)
    q = QUESTIONS[0]
    response = engine.query(q)
    assert isinstance(response, Response)
    assert response.response == expected[q].answer
    assert chunk_ids(response.source_nodes) == [s.chunk_id for s in expected[q].sources]
    for node, src in zip(response.source_nodes, expected[q].sources, strict=True):
        assert node.node.get_content() == src.text and node.score == pytest.approx(src.score)
        assert node.node.metadata["kv_cached"] is True
    stats = response.metadata["blend_stats"]
    assert stats["num_chunks"] == stats["chunks_hit"] == 2
    assert response.metadata["ttft_s"] > 0 and response.metadata["finish_reason"] == "length"


def test_defaults_are_greedy_with_the_pipelines_instruction(rag):
    # temperature 1 (SamplingParams' default) would sample; the engine's default must not.
    q = QUESTIONS[2]
    want = rag.query(q, k=3, sampling_params=SamplingParams(temperature=0.0, max_tokens=128))
    response = BlendKVQueryEngine(rag, similarity_top_k=3).query(q)
    assert response.response == want.answer
    assert rag.instruction and want.prompt["instruction"] == rag.instruction


def test_streaming_joins_to_the_answer_and_fills_sources(rag, expected):
    engine = BlendKVQueryEngine(rag, similarity_top_k=2, sampling_params=GREEDY, streaming=True)
    q = QUESTIONS[1]
    response = engine.query(q)
    assert isinstance(response, StreamingResponse)
    pieces = list(response.response_gen)
    assert len(pieces) > 1 and "".join(pieces).rstrip() == expected[q].answer
    assert chunk_ids(response.source_nodes) == [s.chunk_id for s in expected[q].sources]
    assert response.metadata["blend_stats"]["num_chunks"] == 2


def test_streaming_errors_raise_from_query(rag):
    engine = BlendKVQueryEngine(rag, sampling_params=GREEDY, streaming=True)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.query("   ")


def test_four_threads_get_their_sequential_answers(rag, expected):
    engine = BlendKVQueryEngine(rag, similarity_top_k=2, sampling_params=GREEDY)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(engine.query, QUESTIONS))
    assert [r.response for r in responses] == [expected[q].answer for q in QUESTIONS]


def test_gather_of_aquery_and_async_streams(rag, expected):
    plain = BlendKVQueryEngine(rag, similarity_top_k=2, sampling_params=GREEDY)
    streaming = BlendKVQueryEngine(rag, similarity_top_k=2, sampling_params=GREEDY, streaming=True)

    async def streamed(q: str) -> tuple[str, list[int]]:
        response = await streaming.aquery(q)
        assert isinstance(response, AsyncStreamingResponse)
        text = "".join([t async for t in response.async_response_gen()])
        return text.rstrip(), chunk_ids(response.source_nodes)

    async def run():
        answers = await asyncio.gather(*(plain.aquery(q) for q in QUESTIONS))
        return answers, await asyncio.gather(*map(streamed, QUESTIONS))

    answers, streams = asyncio.run(run())
    assert [r.response for r in answers] == [expected[q].answer for q in QUESTIONS]
    assert [t for t, _ in streams] == [expected[q].answer for q in QUESTIONS]
    assert [ids for _, ids in streams] == [
        [s.chunk_id for s in expected[q].sources] for q in QUESTIONS
    ]


def test_abandoned_stream_aborts_its_request(rag):
    engine = BlendKVQueryEngine(
        rag,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
        streaming=True,
    )
    response = engine.query(QUESTIONS[0])
    next(response.response_gen)
    response.response_gen.close()
    assert not rag.llm.engine.has_unfinished_requests()


def test_query_options_reach_the_pipeline(rag):
    q = QUESTIONS[3]
    for order in ("relevance_first", "relevance_last"):
        want = rag.query(q, k=3, sampling_params=GREEDY, chunk_order=order)
        engine = BlendKVQueryEngine(
            rag, similarity_top_k=3, sampling_params=GREEDY, chunk_order=order
        )
        assert chunk_ids(engine.query(q).source_nodes) == [s.chunk_id for s in want.sources]
    first = rag.query(q, k=3, sampling_params=GREEDY, chunk_order="relevance_first").sources
    assert [s.chunk_id for s in first] != [s.chunk_id for s in want.sources]  # orders differ


def test_retriever_from_four_threads(rag):
    from blendkv.integrations.llamaindex import BlendKVLlamaIndexRetriever

    retriever = BlendKVLlamaIndexRetriever(rag, similarity_top_k=2)
    single = [chunk_ids(retriever.retrieve(q)) for q in QUESTIONS]
    with ThreadPoolExecutor(4) as pool:
        assert [chunk_ids(n) for n in pool.map(retriever.retrieve, QUESTIONS)] == single


def test_a_filter_keeps_retrieval_and_answers_to_one_document(rag):
    eiffel = rag.retrieve("Eiffel Tower wrought iron", k=1)[0]
    assert "Eiffel" in eiffel.text
    doc_id = eiffel.doc_id
    engine = BlendKVQueryEngine(
        rag, similarity_top_k=2, sampling_params=GREEDY, filter={"doc_id": doc_id}
    )
    nodes = engine.retrieve(QueryBundle(QUESTIONS[0]))  # an octopus question, filtered away
    response = engine.query(QUESTIONS[0])
    for found in (nodes, response.source_nodes):
        assert found and {n.node.metadata["doc_id"] for n in found} == {doc_id}
