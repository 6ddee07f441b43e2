"""Seeded synthetic two-hop QA whose hops live in different passages.

Each example asks for an attribute of the person who holds a role on a project::

    passage A: "... The vault code of Project Cobalt is held by Dr. Okafor. ..."
    passage B: "... Dr. Okafor's favourite colour is teal. ..."
    question:  "What is the favourite colour of the person who holds the vault code of
                Project Cobalt?"                                           answer: "teal"

The gold facts sit in different passages, so answering needs cross-chunk attention (what plain
reuse loses). Look-alike distractors; entities drawn without replacement, so one answer.
Deterministic per ``(seed, i)`` (``make_synthetic(5, s)`` is a prefix of ``make_synthetic(10,
s)``); no downloads; :data:`ROLES` and :data:`ATTRIBUTES` are public so tests can check answers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from blendkv.eval.examples import Example, Passage

__all__ = ["ATTRIBUTES", "ROLES", "Attribute", "Role", "make_synthetic"]


@dataclass(frozen=True)
class Role:
    """Hop 1: a project -> person fact. ``sentence`` has ``{project}`` and ``{person}``."""

    clause: str  # completes "the person who ... Project X"
    sentence: str


@dataclass(frozen=True)
class Attribute:
    """Hop 2: a person -> value fact. ``sentence`` has ``{person}`` and ``{value}``."""

    noun: str  # completes "What is the ... of the person who ..."
    sentence: str
    values: tuple[str, ...]


ROLES: tuple[Role, ...] = (
    Role("holds the vault code of", "The vault code of Project {project} is held by {person}."),
    Role("leads", "Project {project} is led by {person}."),
    Role("signs off the budget of", "The budget of Project {project} is signed off by {person}."),
    Role("audits", "The yearly audit of Project {project} is carried out by {person}."),
)

COLOURS = (
    "teal",
    "crimson",
    "amber",
    "violet",
    "olive",
    "indigo",
    "scarlet",
    "ivory",
    "maroon",
    "turquoise",
    "lavender",
    "ochre",
    "silver",
    "coral",
    "navy",
    "beige",
)
CITIES = (
    "Lisbon",
    "Osaka",
    "Quito",
    "Tallinn",
    "Nairobi",
    "Perth",
    "Bergen",
    "Cusco",
    "Dakar",
    "Hanoi",
    "Krakow",
    "Lyon",
    "Mumbai",
    "Porto",
    "Seville",
    "Tbilisi",
)
INSTRUMENTS = (
    "cello",
    "oboe",
    "harp",
    "banjo",
    "tuba",
    "sitar",
    "viola",
    "bassoon",
    "clarinet",
    "mandolin",
    "trombone",
    "ukulele",
    "accordion",
    "piccolo",
    "lute",
    "flute",
)

ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute("favourite colour", "{person}'s favourite colour is {value}.", COLOURS),
    Attribute("home city", "{person}'s home city is {value}.", CITIES),
    Attribute(
        "favourite instrument", "The instrument {person} likes best is the {value}.", INSTRUMENTS
    ),
)

PROJECTS: tuple[str, ...] = (
    "Aurora",
    "Basalt",
    "Cobalt",
    "Dervish",
    "Ember",
    "Falcon",
    "Granite",
    "Harbor",
    "Ironwood",
    "Juniper",
    "Kestrel",
    "Lantern",
    "Monsoon",
    "Nimbus",
    "Obsidian",
    "Pinnacle",
    "Quartz",
    "Riverstone",
    "Sapphire",
    "Tundra",
    "Umbra",
    "Vertex",
    "Willow",
    "Zephyr",
)

SURNAMES: tuple[str, ...] = (
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Tanaka",
    "Alvarez",
    "Kowalski",
    "Haddad",
    "Brennan",
    "Castillo",
    "Dubois",
    "Eriksen",
    "Fontaine",
    "Gallagher",
    "Horvath",
    "Iverson",
    "Jovanovic",
    "Kaur",
    "Larsen",
    "Mbeki",
    "Novak",
    "Oyelaran",
    "Petrov",
    "Quintero",
    "Rasmussen",
)

HONORIFICS: tuple[str, ...] = ("Dr.", "Prof.", "Ms.", "Mr.")

# Neutral sentences that pad passages; none matches a fact template.
FILLER: tuple[str, ...] = (
    "The archive was reorganised during the spring inventory.",
    "Minutes of the quarterly meeting were circulated to all departments.",
    "Several offices moved to the new building on the east campus.",
    "The committee postponed its review until further notice.",
    "A revised safety handbook was distributed to every team.",
    "Visitors must sign in at the front desk before entering the labs.",
    "The cafeteria extended its opening hours for the winter term.",
    "Printed copies of the report are kept in the reading room.",
    "The annual retreat took place in a lodge near the lake.",
    "Maintenance on the ventilation system finished ahead of schedule.",
    "Parking permits are renewed at the start of each quarter.",
    "The newsletter now appears on the first Monday of every month.",
)


def make_synthetic(
    n: int,
    seed: int,
    num_passages: int = 6,
    num_distractor_chains: int | None = None,
    filler_sentences: int = 2,
) -> list[Example]:
    """Make ``n`` two-hop examples, each with ``num_passages`` passages.

    Facts per example: the two gold hops, ``num_distractor_chains`` look-alike chains (two
    facts each; default ``num_passages - 2``, capped by the word lists), one other role on the
    gold project and one other attribute of the gold person. Facts are dealt round-robin over
    the passages (every passage gets at least one), the two gold hops into different passages;
    each passage also gets ``filler_sentences`` neutral sentences, its sentences are shuffled,
    and so is the passage order.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if num_passages < 2:
        raise ValueError(f"num_passages must be >= 2 (the two hops need two), got {num_passages}")
    # Entities drawn without replacement: projects 1 + chains, people 2 + chains (gold, other
    # role holder, chain holders), values 1 + chains per attribute.
    limit = min(len(PROJECTS), len(SURNAMES) - 1, min(len(a.values) for a in ATTRIBUTES)) - 1
    if num_distractor_chains is None:
        chains = min(max(1, num_passages - 2), limit)
    else:
        chains = num_distractor_chains
    if chains < 0:
        raise ValueError(f"num_distractor_chains must be >= 0, got {chains}")
    if filler_sentences < 0:
        raise ValueError(f"filler_sentences must be >= 0, got {filler_sentences}")
    if chains > limit:
        raise ValueError(f"at most {limit} distractor chains fit the built-in word lists")
    if 4 + 2 * chains < num_passages:
        raise ValueError(
            f"{num_passages} passages need at least {(num_passages - 3) // 2} distractor chains "
            "so that every passage holds a fact"
        )
    return [
        _make_example(
            random.Random(f"blendkv-synthetic:{seed}:{i}"),
            f"synthetic-{seed}-{i}",
            num_passages,
            chains,
            filler_sentences,
        )
        for i in range(n)
    ]


def _make_example(
    rng: random.Random, example_id: str, num_passages: int, chains: int, filler: int
) -> Example:
    role, other_role = rng.sample(ROLES, 2)
    attribute, other_attribute = rng.sample(ATTRIBUTES, 2)
    projects = rng.sample(PROJECTS, 1 + chains)
    people = [f"{rng.choice(HONORIFICS)} {s}" for s in rng.sample(SURNAMES, 2 + chains)]
    values = rng.sample(attribute.values, 1 + chains)

    gold_project, gold_person, other_holder = projects[0], people[0], people[1]
    hop1 = role.sentence.format(project=gold_project, person=gold_person)
    hop2 = attribute.sentence.format(person=gold_person, value=values[0])
    other_value = rng.choice(other_attribute.values)
    distractors = [
        other_role.sentence.format(project=gold_project, person=other_holder),
        other_attribute.sentence.format(person=gold_person, value=other_value),
    ]
    for project, person, value in zip(projects[1:], people[2:], values[1:], strict=True):
        distractors.append(role.sentence.format(project=project, person=person))
        distractors.append(attribute.sentence.format(person=person, value=value))
    rng.shuffle(distractors)

    # Deal facts round-robin: hop1 -> bin 0, hop2 -> bin 1, so they never share a passage.
    bins: list[list[str]] = [[] for _ in range(num_passages)]
    for k, fact in enumerate([hop1, hop2, *distractors]):
        bins[k % num_passages].append(fact)
    passages = []
    for sentences in bins:
        sentences = sentences + rng.sample(FILLER, min(filler, len(FILLER)))
        rng.shuffle(sentences)
        passages.append(Passage(title=f"Memo {rng.randrange(100, 1000)}", text=" ".join(sentences)))
    rng.shuffle(passages)

    question = (
        f"What is the {attribute.noun} of the person who {role.clause} Project {gold_project}?"
    )
    return Example(example_id, question, [values[0]], passages)
