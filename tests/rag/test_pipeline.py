"""End to end over the embedded model: ingest -> retrieve -> blended answer, re-ingest,
delete, streaming, and failed ingests that must leave the store intact."""

from __future__ import annotations

from pathlib import Path

import pytest
from rag_helpers import DEMO_DOCS, KNOWN

from blendkv import SamplingParams
from blendkv.errors import BlendKVError, InvalidRequestError
from blendkv.rag import (
    EmptyDocumentError,
    RAGAnswer,
    UnreadableDocumentError,
)

pytestmark = pytest.mark.slow
SHORT = SamplingParams(max_tokens=4, temperature=0.0)


def test_demo_corpus_ingested(rag, demo_report):
    assert len(demo_report.added) == 3 and not demo_report.skipped
    assert demo_report.num_chunks == len(rag.store.indexable_ids()) >= 6
    assert rag.store.verify().ok
    sources = {Path(d["source"]).name for d in rag.documents().values()}
    assert sources == {"python_language.md", "solar_system.md", "honeybees.txt"}


@pytest.mark.parametrize("question", sorted(KNOWN))
def test_retrieve_finds_the_right_chunk(rag, question):
    filename, phrase = KNOWN[question]
    hits = rag.retrieve(question, k=3)
    assert len(hits) == 3
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert phrase in hits[0].text
    assert Path(rag.documents()[hits[0].doc_id]["source"]).name == filename
    assert all(h.kv_cached for h in hits)


def test_query_reuses_stored_kv_every_time(rag):
    question = "Who created the Python programming language?"
    for _ in range(2):  # the second ask must reuse again, not only the first
        answer = rag.query(question, k=3, sampling_params=SHORT)
        st = answer.blend_stats
        assert st.num_chunks == st.chunks_hit == 3
        assert st.chunks_missed == 0
        assert st.tokens_reused == sum(
            len(rag.store.kv.meta_for_id(s.chunk_id).token_ids) for s in answer.sources
        )
        assert 0 < st.recompute_fraction < 0.5
        assert answer.ttft is not None and answer.ttft > 0
        assert "Guido van Rossum" in answer.sources[-1].text  # the best, next to the question
    assert rag.store.verify().ok


def test_stream_query_yields_deltas_then_answer(rag):
    pieces = list(
        rag.stream_query(
            "Which planet is the largest in the Solar System?", k=2, sampling_params=SHORT
        )
    )
    final = pieces[-1]
    assert isinstance(final, RAGAnswer)
    assert all(isinstance(p, str) for p in pieces[:-1])
    assert "".join(pieces[:-1]).strip() == final.answer
    assert final.blend_stats.chunks_hit == 2 and len(final.sources) == 2


def test_reingest_is_a_noop(rag):
    before = len(rag.store.kv)
    report = rag.ingest([DEMO_DOCS], progress=False)
    assert report.added == () and len(report.skipped) == 3 and report.num_chunks == 0
    text = (DEMO_DOCS / "honeybees.txt").read_text()
    [doc_id] = rag.add_documents([text], progress=False)
    assert doc_id in report.doc_ids
    assert rag.ingest(text, progress=False).added == ()  # same content, same default id
    assert len(rag.store.kv) == before


def test_delete_document(rag):
    text = "The okapi is a mammal of the Congo rainforest whose closest relative is the giraffe."
    [doc_id] = rag.add_documents([text], metadata={"topic": "okapi"}, progress=False)
    hits = rag.retrieve("What is the closest relative of the okapi?", k=1)
    assert hits[0].doc_id == doc_id and hits[0].metadata == {"topic": "okapi"}
    assert rag.delete_document(doc_id) == 1
    assert all(h.doc_id != doc_id for h in rag.retrieve("okapi giraffe Congo", k=20))
    assert not rag.has_document(doc_id)
    assert rag.store.verify().ok
    assert rag.delete_document(doc_id) == 0


def test_bad_inputs_write_nothing(rag, tmp_path):
    before = len(rag.store.kv)
    binary = tmp_path / "image.md"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    good = "A new document that must not be stored because its batch fails."
    cases = [
        ([good, binary], UnreadableDocumentError),
        ([good, latin1], UnreadableDocumentError),
        ([good, empty], EmptyDocumentError),
        ([good, ""], EmptyDocumentError),
        ([good, tmp_path / "missing.txt"], UnreadableDocumentError),
        ([good, 42], UnreadableDocumentError),
        ([], EmptyDocumentError),
    ]
    for batch, error in cases:
        with pytest.raises(error) as info:
            rag.add_documents(batch, progress=False)
        assert isinstance(info.value, BlendKVError)
    with pytest.raises(InvalidRequestError):
        rag.retrieve("   ")
    with pytest.raises(InvalidRequestError):
        rag.retrieve("bees", k=0)
    assert len(rag.store.kv) == before and rag.store.verify().ok


def test_failure_mid_ingest_rolls_back(rag, monkeypatch):
    before = len(rag.store.kv)

    def broken(texts):
        raise RuntimeError("embedder crashed")

    monkeypatch.setattr(rag.store.embedder, "embed", broken)
    text = "Saturn's rings are made mostly of water ice, with some rocky material."
    with pytest.raises(RuntimeError, match="embedder crashed"):
        rag.add_documents([text], progress=False)
    monkeypatch.undo()
    assert len(rag.store.kv) == before
    assert rag.store.verify().ok
    # previous documents still answer from their stored K/V
    answer = rag.query("Who created the Python programming language?", k=2, sampling_params=SHORT)
    assert answer.blend_stats.chunks_hit == 2 and answer.blend_stats.chunks_missed == 0
    assert "Guido van Rossum" in answer.sources[-1].text  # the best, next to the question
