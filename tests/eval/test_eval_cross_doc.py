"""The cross-document task: deterministic, answerable, and answerable only from two documents."""

from __future__ import annotations

import re

import pytest

from blendkv.eval.cross_doc import make_cross_doc, record_to_example
from blendkv.eval.datasets import DatasetError, dataset_kind, load_dataset
from blendkv.eval.synthetic import ATTRIBUTES, ROLES

_PERSON = r"(?P<person>(?:Dr|Prof|Ms|Mr)\. [A-Z][a-z]+)"
_VALUE = r"(?P<value>[A-Za-z]+)"


def _hop_patterns(question: str):
    """Regexes for the question's two hops, written from the templates here so that a generator
    that stops stating a hop (or states it twice) fails."""
    for role in ROLES:
        for attribute in ATTRIBUTES:
            prefix = f"What is the {attribute.noun} of the person who {role.clause} Project "
            m = re.fullmatch(re.escape(prefix) + r"([A-Z][a-z]+)\?", question)
            if m:
                hop1 = re.escape(role.sentence).replace(r"\{project\}", m.group(1))
                hop1 = hop1.replace(r"\{person\}", _PERSON)
                hop2 = re.escape(attribute.sentence).replace(r"\{value\}", _VALUE)
                return re.compile(hop1), hop2, m.group(1)
    raise AssertionError(f"unparseable question: {question!r}")


@pytest.mark.parametrize("seed", [0, 7])
def test_every_answer_needs_its_two_gold_documents(seed):
    records = make_cross_doc(12, seed, tokens=4000)
    for r in records:
        texts = [p["paragraph_text"] for p in r["paragraphs"]]
        hop1, hop2_template, project = _hop_patterns(r["question"])
        found1 = [(i, m) for i, t in enumerate(texts) for m in hop1.finditer(t)]
        assert len(found1) == 1, f"{r['id']}: bridge fact missing or ambiguous"
        bridge, person = found1[0][0], found1[0][1].group("person")
        hop2 = re.compile(hop2_template.replace(r"\{person\}", re.escape(person)))
        found2 = [(i, m) for i, t in enumerate(texts) for m in hop2.finditer(t)]
        assert len(found2) == 1, f"{r['id']}: attribute fact missing or ambiguous"
        holder, answer = found2[0][0], found2[0][1].group("value")
        assert answer == r["answer"] and record_to_example(r).answers == [answer]
        assert bridge != holder
        gold = {p["idx"] for p in r["paragraphs"] if p["is_supporting"]}
        assert gold == {bridge, holder}
        decomposition = [h["paragraph_support_idx"] for h in r["question_decomposition"]]
        assert decomposition == [bridge, holder]
        # No single document names both the asked project and the answer.
        assert not [t for t in texts if project in t and re.search(rf"\b{answer}\b", t)]


def test_deterministic_per_seed_and_sized():
    a = make_cross_doc(5, 3, tokens=6000)
    assert a == make_cross_doc(5, 3, tokens=6000)
    assert a[:2] == make_cross_doc(2, 3, tokens=6000)
    assert all(x != y for x, y in zip(a, make_cross_doc(5, 4, tokens=6000), strict=True))
    chars = [sum(len(p["paragraph_text"]) for p in r["paragraphs"]) for r in a]
    assert all(6000 * 4 < c < 6000 * 5.5 for c in chars)  # ~4.6 characters a token
    assert len(a[0]["paragraphs"]) == 15


def test_spec_through_load_dataset():
    spec = "synthetic:cross_doc?seed=7&n=4&tokens=1200"
    assert dataset_kind(spec) == "synthetic"
    examples = load_dataset(spec)
    assert [e.id for e in examples] == [f"cross_doc-7-{i}" for i in range(4)]
    assert load_dataset(spec, limit=2) == examples[:2]
    assert load_dataset("synthetic:cross_doc?n=2&tokens=1200", seed=7) == examples[:2]
    for bad in (
        "synthetic:nope",
        "synthetic:cross_doc?n=x",
        "synthetic:cross_doc?size=3",
        "synthetic:cross_doc?tokens=10",
    ):
        with pytest.raises(DatasetError):
            load_dataset(bad)


@pytest.mark.parametrize("chains", [1, 3])
def test_chains_set_how_many_people_have_the_asked_attribute(chains):
    for r in make_cross_doc(6, 5, tokens=2000, chains=chains):
        hop1, hop2_template, _ = _hop_patterns(r["question"])
        text = " ".join(p["paragraph_text"] for p in r["paragraphs"])
        anyone = re.compile(hop2_template.replace(r"\{person\}", _PERSON))
        assert len(anyone.findall(text)) == chains + 1  # the gold person and one per chain
        assert len(hop1.findall(text)) == 1
    assert make_cross_doc(3, 5, tokens=2000, chains=2) != make_cross_doc(3, 5, tokens=2000)
    for bad in (0, 13):
        with pytest.raises(ValueError, match="chains"):
            make_cross_doc(1, 5, tokens=2000, chains=bad)
    spec = "synthetic:cross_doc?seed=5&n=2&tokens=2000&chains=1"
    assert [e.question for e in load_dataset(spec)] == [
        r["question"] for r in make_cross_doc(2, 5, tokens=2000, chains=1)
    ]
    with pytest.raises(DatasetError, match="chains"):
        load_dataset("synthetic:cross_doc?n=1&chains=0")
