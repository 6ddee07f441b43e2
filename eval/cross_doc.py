"""Seeded cross-document QA at RAG length, in MuSiQue's record format (no data file).

``blendkv eval --data 'synthetic:cross_doc?seed=7&n=50&tokens=6000'``. Each question needs two
documents: the bridge fact (project -> person) in one, the person's attribute in another::

    doc 3:  "... Project Cobalt is led by Dr. Okafor. ..."
    doc 11: "... Dr. Okafor's home city is Quito. ..."
    question: "What is the home city of the person who leads Project Cobalt?"   answer: "Quito"

Distractor documents hold look-alike chains (the same role on other projects, the same attribute
of other people, another role on the gold project, another attribute of the gold person) and
procedurally generated filler, so the prompt reaches about ``tokens`` tokens (estimated at
4.6 characters a token, about right for SmolLM2; no tokenizer here). Facts reuse the templates
and names of :mod:`blendkv.eval.synthetic`. Records follow MuSiQue's shape (``paragraphs``
with ``is_supporting``, ``question_decomposition`` naming the paragraph of each hop), so which
two documents answer is known by construction. Deterministic per ``(seed, i)``.

``chains`` sets how many look-alike chains there are (default: one per document, at most
``MAX_CHAINS``): the asked attribute is then stated for ``chains + 1`` people, so a reader who
skips the bridge fact answers right with probability ``1 / (chains + 1)``. At least one chain is
required: without it the asked attribute is stated once, and the question needs one document.
"""

from __future__ import annotations

import random
from typing import Any

from blendkv.eval.examples import Example, Passage
from blendkv.eval.synthetic import ATTRIBUTES, HONORIFICS, PROJECTS, ROLES, SURNAMES

__all__ = ["CHARS_PER_TOKEN", "cross_doc_examples", "make_cross_doc", "record_to_example"]

CHARS_PER_TOKEN = 4.6  # the estimate the token budget is spent with (SmolLM2's tokenizer)
DOC_TOKENS = 400  # about this many tokens per document
MAX_CHAINS = 12  # look-alike chains (two facts each), capped by the word lists

# Filler vocabulary: none of it is a project, surname, honorific or attribute value.
_TEAMS = (
    "logistics",
    "finance",
    "legal",
    "research",
    "facilities",
    "procurement",
    "outreach",
    "training",
    "payroll",
    "security",
    "catering",
    "records",
)
_THINGS = (
    "chairs",
    "printers",
    "cables",
    "desks",
    "lamps",
    "folders",
    "badges",
    "monitors",
    "keyboards",
    "shelves",
    "routers",
    "whiteboards",
)
_TOPICS = (
    "travel policy",
    "holiday rota",
    "fire drill",
    "parking plan",
    "hiring freeze",
    "energy audit",
    "office move",
    "supplier review",
    "data retention rules",
    "visitor policy",
    "recycling scheme",
    "expense limits",
)
_MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
_FILLER = (
    "The {team} team met on {day} to discuss the {topic}.",
    "A delivery of {n} {thing} reached the {team} office in {month}.",
    "Staff from {team} finished their review of the {topic} in {month}.",
    "The {topic} was circulated to the {team} group on {day}.",
    "Room {room} was booked by {team} every {day} through {month}.",
    "In {month} the {team} unit replaced {n} old {thing}.",
    "Questions about the {topic} go to the {team} desk.",
    "The {team} budget for {thing} was revised in {month}.",
)


def make_cross_doc(
    n: int, seed: int, tokens: int = 6000, chains: int | None = None
) -> list[dict[str, Any]]:
    """``n`` MuSiQue-format records of about ``tokens`` prompt tokens each with ``chains``
    look-alike chains (None: one per document, at most ``MAX_CHAINS``; see the module
    docstring); record ``i`` depends only on ``(seed, i, tokens, chains)``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if tokens < 2 * DOC_TOKENS:
        raise ValueError(f"tokens must be >= {2 * DOC_TOKENS} (two documents), got {tokens}")
    num_docs = min(tokens // DOC_TOKENS, 40)
    if chains is None:
        chains = min(MAX_CHAINS, num_docs)
    elif not 1 <= chains <= MAX_CHAINS:
        raise ValueError(f"chains must be in [1, {MAX_CHAINS}], got {chains}")
    return [
        _make_record(
            random.Random(f"blendkv-cross-doc:{seed}:{i}"),
            f"cross_doc-{seed}-{i}",
            num_docs,
            int(tokens * CHARS_PER_TOKEN / num_docs),
            chains,
        )
        for i in range(n)
    ]


def record_to_example(record: dict[str, Any]) -> Example:
    """The eval :class:`Example` of a MuSiQue-format record (paragraphs in record order)."""
    passages = [Passage(p["title"], p["paragraph_text"]) for p in record["paragraphs"]]
    answers = [record["answer"], *record.get("answer_aliases", [])]
    return Example(record["id"], record["question"], answers, passages)


def cross_doc_examples(
    n: int, seed: int, tokens: int = 6000, chains: int | None = None
) -> list[Example]:
    return [record_to_example(r) for r in make_cross_doc(n, seed, tokens, chains)]


def _filler(rng: random.Random) -> str:
    return rng.choice(_FILLER).format(
        team=rng.choice(_TEAMS),
        thing=rng.choice(_THINGS),
        topic=rng.choice(_TOPICS),
        month=rng.choice(_MONTHS),
        day=rng.choice(_DAYS),
        n=rng.randrange(2, 40),
        room=rng.randrange(100, 999),
    )


def _make_record(
    rng: random.Random, rid: str, num_docs: int, doc_chars: int, chains: int
) -> dict[str, Any]:
    role, other_role = rng.sample(ROLES, 2)
    attribute, other_attribute = rng.sample(ATTRIBUTES, 2)
    projects = rng.sample(PROJECTS, 1 + chains)
    people = [f"{rng.choice(HONORIFICS)} {s}" for s in rng.sample(SURNAMES, 2 + chains)]
    values = rng.sample(attribute.values, 1 + chains)
    gold_project, gold_person, answer = projects[0], people[0], values[0]

    bridge_doc, answer_doc = rng.sample(range(num_docs), 2)
    facts: list[list[str]] = [[] for _ in range(num_docs)]
    facts[bridge_doc].append(role.sentence.format(project=gold_project, person=gold_person))
    facts[answer_doc].append(attribute.sentence.format(person=gold_person, value=answer))
    others = [d for d in range(num_docs) if d not in (bridge_doc, answer_doc)] or [answer_doc]
    # The gold project's other role and the gold person's other attribute: never the answer.
    facts[rng.choice(others)].append(
        other_role.sentence.format(project=gold_project, person=people[1])
    )
    facts[rng.choice(others)].append(
        other_attribute.sentence.format(
            person=gold_person, value=rng.choice([v for v in other_attribute.values if v != answer])
        )
    )
    for project, person, value in zip(projects[1:], people[2:], values[1:], strict=True):
        a, b = rng.sample(range(num_docs), 2)  # each chain spans two documents too
        facts[a].append(role.sentence.format(project=project, person=person))
        facts[b].append(attribute.sentence.format(person=person, value=value))

    paragraphs = []
    for d, doc_facts in enumerate(facts):
        sentences = list(doc_facts)
        while sum(len(s) + 1 for s in sentences) < doc_chars:
            sentences.append(_filler(rng))
        rng.shuffle(sentences)
        paragraphs.append(
            {
                "idx": d,
                "title": f"Memo {rng.randrange(100, 1000)}",
                "paragraph_text": " ".join(sentences),
                "is_supporting": d in (bridge_doc, answer_doc),
            }
        )
    hop1 = f"Who {role.clause} Project {gold_project}?"
    hop2 = f"What is the {attribute.noun} of {gold_person}?"
    return {
        "id": rid,
        "question": (
            f"What is the {attribute.noun} of the person who {role.clause} Project {gold_project}?"
        ),
        "answer": answer,
        "answer_aliases": [],
        "answerable": True,
        "paragraphs": paragraphs,
        "question_decomposition": [
            {"id": 1, "question": hop1, "answer": gold_person, "paragraph_support_idx": bridge_doc},
            {"id": 2, "question": hop2, "answer": answer, "paragraph_support_idx": answer_doc},
        ],
    }
