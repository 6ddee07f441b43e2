"""Lone surrogates (U+D800..U+DFFF, common in text extracted from PDFs) at every entry point:
replaced by U+FFFD with a warning naming where and at which character offset, and the engine
keeps serving. Before, the tokenizer raised a bare TypeError."""

from __future__ import annotations

import logging

import pytest

from blendkv import SamplingParams
from blendkv.rag import DocumentError
from blendkv.rag.documents import content_doc_id
from blendkv.text import replace_lone_surrogates

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
BAD, FIX = "\ud800", "\ufffd"


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "blendkv.text"]


def test_replace_lone_surrogates_semantics(caplog):
    caplog.set_level(logging.WARNING, logger="blendkv.text")
    assert replace_lone_surrogates("clean café 😀", "x") == "clean café 😀"
    assert warnings_of(caplog) == []
    text = "a \ud83d\ude00 b \ud800 c \udc00\udc00 d \ud800"
    assert replace_lone_surrogates(text, "doc 7") == f"a 😀 b {FIX} c {FIX}{FIX} d {FIX}"
    [message] = warnings_of(caplog)
    assert "doc 7" in message and "offset(s) 7, 11, 12, 16" in message
    many = BAD * 7
    assert replace_lone_surrogates(many, "q") == FIX * 7
    assert "0, 1, 2, 3, 4 (and 2 more)" in warnings_of(caplog)[-1]


def test_generate_and_blended_prompts(tiny_rag, caplog):
    caplog.set_level(logging.WARNING, logger="blendkv.text")
    llm = tiny_rag.llm
    [out] = llm.generate([f"bad {BAD} text"], GREEDY)
    [ref] = llm.generate([f"bad {FIX} text"], GREEDY)
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert "prompt" in warnings_of(caplog)[0] and "offset(s) 4" in warnings_of(caplog)[0]

    def blended(mark: str) -> dict:
        return {
            "documents": ["Paris is the capital of France.", f"Berlin {mark} is in Germany."],
            "query": f"Which {mark} city?",
            "system": f"Be brief {mark}.",
            "instruction": f"Answer {mark} from the passages.\n",
        }

    caplog.clear()
    [out] = llm.generate([blended(BAD)], GREEDY)
    [ref] = llm.generate([blended(FIX)], GREEDY)
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    named = " | ".join(warnings_of(caplog))
    for where in ("documents[1]", "query", "system", "instruction"):
        assert f"blended prompt {where}" in named
    assert "documents[0]" not in named


def test_rag_ingest_and_query(tiny_rag, caplog):
    caplog.set_level(logging.WARNING, logger="blendkv.text")
    rag = tiny_rag
    text = f"The okapi {BAD} lives in the rainforests of the Congo. It eats leaves."
    report = rag.ingest([text], progress=False)
    [doc_id] = report.added
    assert doc_id == content_doc_id(text.replace(BAD, FIX))
    assert "document 0" in warnings_of(caplog)[0] and "offset(s) 10" in warnings_of(caplog)[0]
    stored = " ".join(m.text for m in rag.store.kv.document_chunks(doc_id))
    assert FIX in stored and BAD not in stored
    assert rag.ingest([text], progress=False).skipped == (doc_id,)  # same text, same id

    caplog.clear()
    answer = rag.query(f"Where does the okapi {BAD} live?", k=1, sampling_params=GREEDY)
    ref = rag.query(f"Where does the okapi {FIX} live?", k=1, sampling_params=GREEDY)
    assert answer.answer == ref.answer and answer.sources == ref.sources
    assert answer.sources[0].doc_id == doc_id
    assert any(m.startswith("question") for m in warnings_of(caplog))
    assert rag.retrieve(f"okapi {BAD}", k=1)[0].doc_id == doc_id
    assert rag.store.verify().ok


def test_doc_ids_and_metadata_with_lone_surrogates_are_refused(tiny_rag):
    rag = tiny_rag
    before = len(rag.store.kv)
    text = "Giraffes are the tallest living animals."
    with pytest.raises(DocumentError, match="lone surrogates"):
        rag.ingest([text], doc_ids=[f"id-{BAD}"], progress=False)
    with pytest.raises(DocumentError, match="UTF-8"):
        rag.ingest([text], metadata={"title": f"t {BAD}"}, progress=False)
    assert len(rag.store.kv) == before and not rag.has_document(content_doc_id(text))
    assert rag.store.verify().ok


def test_chat_messages(rag, caplog):
    """The embedded model has a chat template (the tiny one has none)."""
    caplog.set_level(logging.WARNING, logger="blendkv.text")
    llm = rag.llm
    [out] = llm.chat([{"role": "user", "content": f"Say {BAD} hi."}], GREEDY)
    [ref] = llm.chat([{"role": "user", "content": f"Say {FIX} hi."}], GREEDY)
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert "message 0 content" in warnings_of(caplog)[0]
