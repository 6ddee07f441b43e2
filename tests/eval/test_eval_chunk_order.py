"""``blendkv eval --chunk-order``: passages ranked by the pipeline's embedder, best first or
last, or left in the data set's order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from blendkv.cli import main
from blendkv.eval.examples import Example, Passage
from blendkv.eval.journal import Journal, JournalError
from blendkv.eval.ordering import order_examples, relevance_ranks
from blendkv.eval.runner import EvalConfig
from blendkv.rag.chunk_order import ChunkOrderError
from blendkv.rag.embedding import MiniLMEmbedder

from .test_eval_resume import SETTINGS

PASSAGES = [
    Passage("", "The recipe needs flour, butter and two eggs."),
    Passage("Mount Everest", "Mount Everest is 8,849 metres high, the highest mountain."),
    Passage("", "Football is played by two teams of eleven players."),
    Passage("K2", "K2 is the second-highest mountain on Earth."),
]
EXAMPLE = Example("e0", "How high is Mount Everest?", ["8,849 metres"], PASSAGES)


@pytest.fixture(scope="module")
def embedder():
    return MiniLMEmbedder()


def test_relevance_orders_follow_the_embedder_ranking(embedder):
    ranks = relevance_ranks(EXAMPLE, embedder)
    texts = [f"{p.title}\n{p.text}" if p.title else p.text for p in PASSAGES]
    vectors = embedder.embed([EXAMPLE.question, *texts])
    assert ranks == list(np.argsort(-(vectors[1:] @ vectors[0])))
    assert ranks[0] == 1 and ranks[1] == 3  # Everest, then the other mountain
    [first] = order_examples([EXAMPLE], "relevance_first", embedder)
    [last] = order_examples([EXAMPLE], "relevance_last", embedder)
    [source] = order_examples([EXAMPLE], "source", embedder)
    assert first.passages == [PASSAGES[i] for i in ranks]
    assert last.passages == first.passages[::-1]
    assert last.passages[-1] is PASSAGES[1]  # the best passage sits next to the question
    assert source.passages == PASSAGES
    assert (first.id, first.question, first.answers) == (
        EXAMPLE.id,
        EXAMPLE.question,
        ["8,849 metres"],
    )


def test_unknown_order_is_a_typed_error_before_any_model_loads(tmp_path, capsys):
    with pytest.raises(ChunkOrderError, match="relevance_last, relevance_first, source"):
        EvalConfig(data="synthetic", chunk_order="best")
    argv = ["eval", "--data", "synthetic", "--chunk-order", "best", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "unknown chunk order 'best'" in capsys.readouterr().err


def test_journal_before_the_option_resumes_in_source_order(tmp_path):
    Journal(tmp_path, SETTINGS, ["full"], resume=False).start({})
    path = tmp_path / "run_config.json"
    doc = json.loads(path.read_text())
    del doc["settings"]["chunk_order"]
    path.write_text(json.dumps(doc))
    assert Journal(tmp_path, SETTINGS, ["full"], resume=True).records == []
    with pytest.raises(JournalError, match=r"chunk_order: 'source' there, 'relevance_last' now"):
        Journal(tmp_path, {**SETTINGS, "chunk_order": "relevance_last"}, ["full"], resume=True)


def test_cli_runs_in_the_order_asked_for(tmp_path, eval_model_dir):
    out = tmp_path / "run"
    argv = ["eval", "--model", str(eval_model_dir), "--data", "synthetic", "--limit", "1"]
    argv += ["--methods", "full"]
    argv += ["--dtype", "float32", "--max-tokens", "2", "--no-progress", "--out", str(out)]
    assert main([*argv, "--chunk-order", "relevance_last"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["chunk_order"] == "relevance_last"
