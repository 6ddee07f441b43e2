"""Chunk order in RAG prompts: the prompt's chunk ids and the answer's sources follow the order
asked for (pipeline default, per query, ``blendkv ask --chunk-order``); unknown orders are
typed errors."""

from __future__ import annotations

import json

import pytest
from helpers import QUIET_FLAGS, QuietLLM
from rag_helpers import DEMO_DOCS

from blendkv import SamplingParams
from blendkv.cli import main
from blendkv.rag import RAGPipeline, RetrievedChunk
from blendkv.rag.chunk_order import (
    CHUNK_ORDERS,
    DEFAULT_CHUNK_ORDER,
    ChunkOrderError,
    order_chunks,
)

QUESTION = "Who created Python, and which planet is the largest?"
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def _chunk(chunk_id, doc_id, position, source=None, score=0.0):
    return RetrievedChunk(chunk_id, doc_id, f"text {chunk_id}", score, True, position, {}, source)


def test_order_chunks_without_a_model():
    best_first = [
        _chunk(7, "d2", 3, "b.md"),
        _chunk(1, "d1", 1, "a.md"),
        _chunk(9, "d3", 0),  # no source: sorted by its doc id
        _chunk(6, "d2", 0, "b.md"),
        _chunk(0, "d1", 0, "a.md"),
    ]
    ids = {o: [c.chunk_id for c in order_chunks(best_first, o)] for o in CHUNK_ORDERS}
    assert ids["relevance_first"] == [7, 1, 9, 6, 0]
    assert ids["relevance_last"] == [0, 6, 9, 1, 7]
    assert ids["source"] == [0, 1, 6, 7, 9]  # a.md #0 #1, b.md #0 #3, then d3
    with pytest.raises(ChunkOrderError, match="unknown chunk order 'best'"):
        order_chunks(best_first, "best")


@pytest.fixture(scope="module")
def ingested(tiny_rag):
    tiny_rag.ingest(paths=[DEMO_DOCS], progress=False)
    return tiny_rag


@pytest.mark.parametrize("order", CHUNK_ORDERS)
def test_query_puts_chunks_in_the_order_asked_for(ingested, order):
    best = ingested.retrieve(QUESTION, 8)
    assert len({c.doc_id for c in best}) > 1  # several documents, so the orders differ
    expected = {
        "relevance_first": best,
        "relevance_last": best[::-1],
        "source": sorted(best, key=lambda c: (c.source, c.doc_id, c.position)),
    }[order]
    answer = ingested.query(QUESTION, 8, PARAMS, chunk_order=order)
    assert answer.prompt["chunk_ids"] == [c.chunk_id for c in expected]
    assert [c.chunk_id for c in answer.sources] == answer.prompt["chunk_ids"]
    streamed = list(ingested.stream_query(QUESTION, 8, PARAMS, chunk_order=order))[-1]
    assert streamed.prompt["chunk_ids"] == answer.prompt["chunk_ids"]


def test_pipeline_default_and_its_own_order(ingested, tiny_llama_dir, tmp_path):
    best = [c.chunk_id for c in ingested.retrieve(QUESTION, 4)]
    default = ingested.query(QUESTION, 4, PARAMS)
    assert ingested.chunk_order == DEFAULT_CHUNK_ORDER == "relevance_last"
    assert default.prompt["chunk_ids"] == best[::-1]  # the best chunk next to the question
    assert default.sources[-1].score == max(s.score for s in default.sources)
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    with RAGPipeline(tmp_path / "s", llm=llm, chunk_order="relevance_first") as other:
        other.ingest(paths=[DEMO_DOCS], progress=False)
        best = [c.chunk_id for c in other.retrieve(QUESTION, 4)]
        assert other.query(QUESTION, 4, PARAMS).prompt["chunk_ids"] == best
        reordered = other.query(QUESTION, 4, PARAMS, chunk_order="relevance_last")
        assert reordered.prompt["chunk_ids"] == best[::-1]
    llm.close()


def test_unknown_order_is_a_typed_error(ingested, tmp_path):
    with pytest.raises(ChunkOrderError, match="use one of relevance_last, relevance_first"):
        ingested.query(QUESTION, 2, PARAMS, chunk_order="best_first")
    with pytest.raises(ChunkOrderError):
        RAGPipeline(tmp_path / "s", llm=ingested.llm, chunk_order="random")
    assert not (tmp_path / "s").exists()  # refused before the store is created


def test_ask_chunk_order_flag(ingested, tiny_llama_dir, capsys):
    store = str(ingested.store_dir)
    args = ["--store", store, "--model", str(tiny_llama_dir), "--dtype", "float32", *QUIET_FLAGS]
    args += ["--top-k", "4", "--max-tokens", "1", "--json"]
    ids = {}
    ingested.close()  # one process opens a store once
    for order in ("relevance_first", "relevance_last"):
        assert main(["ask", QUESTION, "--chunk-order", order, *args]) == 0
        ids[order] = [s["chunk_id"] for s in json.loads(capsys.readouterr().out)["sources"]]
    assert ids["relevance_last"] == ids["relevance_first"][::-1]
    assert main(["ask", QUESTION, "--chunk-order", "best", *args]) == 2
    assert "unknown chunk order 'best'" in capsys.readouterr().err
