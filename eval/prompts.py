"""Prompt pieces as data: a system prefix, one string per passage, and a query suffix.

Each piece is tokenised on its own (DESIGN §4 "Tokens, not text")::

    system | documents[0] | documents[1] | ... | documents[n-1] | query
    anchor   chunk 0        chunk 1              chunk n-1        always recomputed

Chat-template tokens are not in these strings: the harness wraps them around the pieces at the
token level. ``musique`` is CacheBlend's ``example/blend_musique.py`` prompt verbatim (passages
``"{title}\\n\\n{text}\\n\\n"``, the question through :func:`normalize_question` after
``"Question:"``); ``longbench`` is LongBench's multi-document QA prompt cut the same way.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from blendkv.eval.examples import Example, Passage

__all__ = [
    "DEFAULT_PROMPTS",
    "PromptSpec",
    "RenderedPrompt",
    "get_prompt_spec",
    "normalize_question",
    "render_passage",
    "render_prompt",
]


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


@dataclass(frozen=True)
class PromptSpec:
    """How an :class:`Example` becomes prompt pieces.

    ``passage_template`` may use ``{title}`` and must use ``{text}``; ``query_template`` must
    use ``{question}``. Literal braces are written ``{{``/``}}``. With ``normalize_question``
    the question is first passed through :func:`normalize_question`.
    """

    system: str
    passage_template: str
    query_template: str
    normalize_question: bool = False

    def __post_init__(self) -> None:
        passage_fields = _fields(self.passage_template)
        if "text" not in passage_fields or not passage_fields <= {"title", "text"}:
            raise ValueError(
                "passage_template must use {text} and may use {title}, nothing else; "
                f"got fields {sorted(passage_fields)}"
            )
        if _fields(self.query_template) != {"question"}:
            raise ValueError(
                "query_template must use {question} and no other field; "
                f"got fields {sorted(_fields(self.query_template))}"
            )


class RenderedPrompt(NamedTuple):
    system: str  # the anchor prefix, shared by every request of the data set
    documents: list[str]  # one string per passage, in prompt order
    query: str  # question suffix, ends where the answer begins


def normalize_question(question: str) -> str:
    """CacheBlend's question normalisation: end with ``?`` and lowercase the first letter."""
    question = question.strip()
    if not question:
        return question
    if not question.endswith("?"):
        question += "?"
    return question[0].lower() + question[1:]


def render_passage(passage: Passage, spec: PromptSpec) -> str:
    return spec.passage_template.format(title=passage.title, text=passage.text)


def render_prompt(example: Example, spec: PromptSpec) -> RenderedPrompt:
    """The pieces of ``example``'s prompt under ``spec`` (see the module docstring)."""
    question = normalize_question(example.question) if spec.normalize_question else example.question
    return RenderedPrompt(
        system=spec.system,
        documents=[render_passage(p, spec) for p in example.passages],
        query=spec.query_template.format(question=question),
    )


_CACHEBLEND_INSTRUCTION = (
    "Answer the question directly based on the given passages. Do NOT repeat the question. "
    "The answer should be within 5 words."
)

MUSIQUE_PROMPT = PromptSpec(
    # The double full stop is in CacheBlend's prompt; kept so results compare with it.
    system=(
        "You will be asked a question after reading several passages. Please directly answer "
        "the question based on the given passages. Do NOT repeat the question. The answer "
        "should be within 5 words..\nPassages:\n"
    ),
    passage_template="{title}\n\n{text}\n\n",
    query_template="\n\n" + _CACHEBLEND_INSTRUCTION + " \nQuestion:{question}\nAnswer:",
    normalize_question=True,
)

# Same wording as musique, but the synthetic passages carry real titles ("Memo 123") and the
# question is left as generated.
SYNTHETIC_PROMPT = PromptSpec(
    system=MUSIQUE_PROMPT.system,
    passage_template="{title}\n{text}\n\n",
    query_template="\n\n" + _CACHEBLEND_INSTRUCTION + "\nQuestion: {question}\nAnswer:",
)

_LONGBENCH_INSTRUCTION = (
    "Answer the question based on the given passages. "
    "Only give me the answer and do not output any other words."
)

LONGBENCH_PROMPT = PromptSpec(
    system=_LONGBENCH_INSTRUCTION + "\n\nThe following are given passages.\n",
    passage_template="{title}\n{text}\n\n",
    query_template="\n\n" + _LONGBENCH_INSTRUCTION + "\n\nQuestion: {question}\nAnswer:",
)

DEFAULT_PROMPTS: MappingProxyType[str, PromptSpec] = MappingProxyType(
    {"musique": MUSIQUE_PROMPT, "synthetic": SYNTHETIC_PROMPT, "longbench": LONGBENCH_PROMPT}
)


def get_prompt_spec(kind: str) -> PromptSpec:
    """The default prompt of a dataset kind (see ``blendkv.eval.datasets.dataset_kind``)."""
    try:
        return DEFAULT_PROMPTS[kind]
    except KeyError:
        raise ValueError(
            f"no default prompt for dataset kind {kind!r}; known: {sorted(DEFAULT_PROMPTS)}"
        ) from None
