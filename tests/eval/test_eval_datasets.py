from __future__ import annotations

import json
from pathlib import Path

import pytest

from blendkv.errors import BlendKVError
from blendkv.eval.datasets import (
    DatasetError,
    Example,
    Passage,
    dataset_kind,
    load_cacheblend_json,
    load_dataset,
    load_longbench_jsonl,
    split_context,
)

# tests/eval/<this file> -> parents[2] is the repository root; CI keeps ../shared beside it.
MUSIQUE = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "musique_dev.json"


@pytest.mark.skipif(not MUSIQUE.exists(), reason="shared MuSiQue data not present")
def test_musique_loads_50_examples_with_10_passages():
    examples = load_cacheblend_json(MUSIQUE)
    assert len(examples) == 50
    assert all(len(ex.passages) == 10 for ex in examples)
    assert all(ex.answers and all(isinstance(a, str) for a in ex.answers) for ex in examples)
    assert len({ex.id for ex in examples}) == 50
    first = examples[0]
    assert first.question == "Where was the author of Hannibal and Scipio educated at?"
    assert first.answers == ["Exeter College"]
    assert first.passages[0].text.startswith("thriller television series")
    assert [ex.id for ex in load_cacheblend_json(MUSIQUE, limit=3)] == [e.id for e in examples[:3]]


def _write_json(tmp_path: Path, data) -> Path:
    path = tmp_path / "data.json"
    path.write_text(json.dumps(data))
    return path


def _record(**overrides):
    record = {"question": "Who?", "answers": ["Ann"], "ctxs": [{"title": "T", "text": "Ann."}]}
    record.update(overrides)
    return record


def test_cacheblend_answer_string_id_and_missing_title(tmp_path):
    path = _write_json(
        tmp_path,
        [
            _record(answers="Ann", ctxs=[{"text": "x"}, {"title": "B", "text": "y"}]),
            _record(_id="abc"),
        ],
    )
    a, b = load_cacheblend_json(path)
    assert a == Example("data-0", "Who?", ["Ann"], [Passage("", "x"), Passage("B", "y")])
    assert b.id == "abc"
    assert load_cacheblend_json(path, limit=0) == []


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"answers": ["Ann"], "ctxs": [{"text": "x"}]}, "missing field 'question'"),
        (_record(answers=[]), "'answers'"),
        (_record(answers=[3]), "'answers'"),
        (_record(ctxs=[]), "'ctxs'"),
        (_record(ctxs=[{"title": "T"}]), r"ctxs\[0\]: missing field 'text'"),
        (_record(question=7), "'question' must be a string"),
        ("not an object", "expected an object"),
    ],
)
def test_cacheblend_malformed_record_names_file_and_index(tmp_path, bad, message):
    path = _write_json(tmp_path, [_record(), _record(), bad])
    with pytest.raises(DatasetError, match=message) as info:
        load_cacheblend_json(path)
    assert f"{path}: record 2" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, BlendKVError)


def test_cacheblend_bad_files(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('[{"question": "x",\n  oops]')
    with pytest.raises(DatasetError, match=r"broken.json: invalid JSON at line 2"):
        load_cacheblend_json(broken)
    with pytest.raises(DatasetError, match="expected a JSON list"):
        load_cacheblend_json(_write_json(tmp_path, {"question": "x"}))
    with pytest.raises(DatasetError, match="no such data file"):
        load_cacheblend_json(tmp_path / "missing.json")


LONGBENCH_CONTEXT = (
    "Passage 1:\nMichael Haneke\nMichael Haneke is an Austrian film director.\n"
    "Passage 2:\nFunny Games\nFunny Games is a 1997 film.\nIt was remade in 2007.\n"
    "Passage 3:\nA passage with no title line"
)


def test_split_context_on_passage_markers():
    assert split_context(LONGBENCH_CONTEXT) == [
        Passage("Michael Haneke", "Michael Haneke is an Austrian film director."),
        Passage("Funny Games", "Funny Games is a 1997 film.\nIt was remade in 2007."),
        Passage("", "A passage with no title line"),
    ]


def test_split_context_on_blank_lines():
    text = "First paragraph\nstill first.\n\n  \nSecond paragraph.\n\n\nThird."
    assert split_context(text) == [
        Passage("", "First paragraph\nstill first."),
        Passage("", "Second paragraph."),
        Passage("", "Third."),
    ]
    assert split_context("One block only.") == [Passage("", "One block only.")]


def _write_jsonl(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "lb.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_longbench_jsonl_fixture(tmp_path):
    rec1 = {
        "input": "Who directed Funny Games?",
        "context": LONGBENCH_CONTEXT,
        "answers": ["Michael Haneke"],
        "_id": "hp-7",
        "length": 30,
    }
    rec2 = {
        "input": "What colour?",
        "context": "Sky is blue.\n\nGrass is green.",
        "answers": "blue",
    }
    path = _write_jsonl(tmp_path, [json.dumps(rec1), "", json.dumps(rec2)])
    a, b = load_longbench_jsonl(path)
    assert (a.id, a.question, a.answers, len(a.passages)) == (
        "hp-7",
        "Who directed Funny Games?",
        ["Michael Haneke"],
        3,
    )
    assert a.passages[1].title == "Funny Games"
    # No _id: the file stem and the record index.
    assert b == Example(
        "lb-1",
        "What colour?",
        ["blue"],
        [Passage("", "Sky is blue."), Passage("", "Grass is green.")],
    )
    assert len(load_longbench_jsonl(path, limit=1)) == 1


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"context": "c", "answers": ["a"]}), "missing field 'input'"),
        (json.dumps({"input": "q", "context": "  \n\n ", "answers": ["a"]}), "empty 'context'"),
        (json.dumps({"input": "q", "context": "c", "answers": {"a": 1}}), "'answers'"),
        (json.dumps(["q"]), "expected an object"),
    ],
)
def test_longbench_malformed_line_names_record_and_line(tmp_path, bad, message):
    good = json.dumps({"input": "q", "context": "c", "answers": ["a"]})
    path = _write_jsonl(tmp_path, [good, "", bad])
    with pytest.raises(DatasetError, match=message) as info:
        load_longbench_jsonl(path)
    assert f"{path}: record 1 (line 3)" in str(info.value)


def test_load_dataset_dispatch(tmp_path):
    synthetic = load_dataset("synthetic", limit=3, seed=1)
    assert len(synthetic) == 3 and synthetic == load_dataset("synthetic", limit=3, seed=1)
    assert synthetic != load_dataset("synthetic", limit=3, seed=2)
    assert len(load_dataset("synthetic")) == 50

    json_path = _write_json(tmp_path, [_record(), _record()])
    assert len(load_dataset(json_path, limit=1)) == 1
    jsonl_path = _write_jsonl(
        tmp_path, [json.dumps({"input": "q", "context": "c", "answers": "a"})]
    )
    assert load_dataset(str(jsonl_path))[0].answers == ["a"]

    assert [dataset_kind(s) for s in ("synthetic", json_path, jsonl_path)] == [
        "synthetic",
        "musique",
        "longbench",
    ]
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset(tmp_path / "data.csv")
    with pytest.raises(DatasetError, match="limit"):
        load_dataset("synthetic", limit=-1)


def test_offset_takes_a_slice():
    whole = load_dataset("synthetic", 6, seed=3)
    assert [e.id for e in load_dataset("synthetic", 2, seed=3, offset=4)] == [
        e.id for e in whole[4:6]
    ]
    assert (
        len(load_dataset("synthetic", None, seed=3, offset=4))
        == len(load_dataset("synthetic", None, seed=3)) - 4
    )
    with pytest.raises(DatasetError, match="offset"):
        load_dataset("synthetic", 2, offset=-1)
