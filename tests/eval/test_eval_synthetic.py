from __future__ import annotations

import re

import pytest

from blendkv.eval.synthetic import ATTRIBUTES, ROLES, make_synthetic

# Patterns for the placeholders, written here (not taken from the generator) so that a change
# in the generator's names or sentences that breaks resolution makes these tests fail.
_PLACEHOLDERS = {
    "project": r"(?P<project>[A-Z][a-z]+)",
    "person": r"(?P<person>(?:Dr|Prof|Ms|Mr)\. [A-Z][a-z]+)",
    "value": r"(?P<value>[A-Za-z]+)",
}


def _pattern(sentence_template: str, **fixed: str) -> re.Pattern[str]:
    """A regex for a fact template, with some placeholders pinned to given values."""
    parts = re.split(r"\{(\w+)\}", sentence_template)
    out = []
    for k, part in enumerate(parts):
        if k % 2 == 0:
            out.append(re.escape(part))
        else:
            out.append(re.escape(fixed[part]) if part in fixed else _PLACEHOLDERS[part])
    return re.compile("".join(out))


def _parse_question(question: str):
    for role in ROLES:
        for attribute in ATTRIBUTES:
            prefix = f"What is the {attribute.noun} of the person who {role.clause} Project "
            m = re.fullmatch(re.escape(prefix) + r"([A-Z][a-z]+)\?", question)
            if m:
                return role, attribute, m.group(1)
    raise AssertionError(f"unparseable question: {question!r}")


def _resolve(example):
    """Follow the two hops through the passage texts; returns (answer, hop passage indices)."""
    role, attribute, project = _parse_question(example.question)
    texts = [p.text for p in example.passages]
    hop1 = [
        (i, m)
        for i, t in enumerate(texts)
        for m in _pattern(role.sentence, project=project).finditer(t)
    ]
    assert len(hop1) == 1, f"{example.id}: hop 1 is ambiguous or missing: {hop1}"
    i1, m1 = hop1[0]
    person = m1.group("person")
    hop2 = [
        (i, m)
        for i, t in enumerate(texts)
        for m in _pattern(attribute.sentence, person=person).finditer(t)
    ]
    assert len(hop2) == 1, f"{example.id}: hop 2 is ambiguous or missing: {hop2}"
    i2, m2 = hop2[0]
    return m2.group("value"), i1, i2


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("num_passages", [2, 6, 10])
def test_answers_recoverable_and_hops_in_different_passages(seed, num_passages):
    examples = make_synthetic(20, seed, num_passages=num_passages)
    assert len(examples) == 20
    for ex in examples:
        assert len(ex.passages) == num_passages
        answer, i1, i2 = _resolve(ex)
        assert [answer] == ex.answers
        assert i1 != i2, f"{ex.id}: both hops in passage {i1}"
        # The answer word never occurs in the hop-1 passage alone.
        assert answer not in ex.passages[i1].text


def test_distractors_look_alike():
    for ex in make_synthetic(10, 3):
        role, attribute, _ = _parse_question(ex.question)
        text = " ".join(p.text for p in ex.passages)
        # Other projects with the same role, and other people with the same attribute.
        assert len(_pattern(role.sentence).findall(text)) >= 3
        assert len(_pattern(attribute.sentence).findall(text)) >= 3


def test_deterministic_given_seed():
    a = make_synthetic(8, seed=123)
    assert a == make_synthetic(8, seed=123)
    assert a[:3] == make_synthetic(3, seed=123)  # example i does not depend on n
    b = make_synthetic(8, seed=124)
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert len({ex.id for ex in a + b}) == 16
    # Varied across examples: not one question repeated.
    assert len({ex.question for ex in make_synthetic(30, 0)}) > 20


def test_passage_order_is_shuffled():
    # Hop 1 is not always in the same slot.
    slots = {_resolve(ex)[1] for ex in make_synthetic(30, 5)}
    assert len(slots) > 2


def test_argument_validation():
    assert make_synthetic(0, 0) == []
    with pytest.raises(ValueError):
        make_synthetic(1, 0, num_passages=1)
    with pytest.raises(ValueError):
        make_synthetic(1, 0, num_distractor_chains=1000)
    with pytest.raises(ValueError, match="distractor chains"):
        make_synthetic(1, 0, num_passages=10, num_distractor_chains=0)
    ex = make_synthetic(1, 0, num_passages=3, num_distractor_chains=0, filler_sentences=0)[0]
    assert _resolve(ex)[0] == ex.answers[0]
