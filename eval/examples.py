"""The in-memory shape of every evaluation data set: an :class:`Example` (a question, its gold
answers, its passages). Its own module so that the loaders (:mod:`blendkv.eval.datasets`) and
the generator (:mod:`blendkv.eval.synthetic`) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Example", "Passage"]


@dataclass(frozen=True)
class Passage:
    """One retrieved document; the engine prefills each passage as its own chunk."""

    title: str
    text: str


@dataclass(frozen=True)
class Example:
    """One question with its gold answers and passages (in prompt order)."""

    id: str
    question: str
    answers: list[str]
    passages: list[Passage]

    def __post_init__(self) -> None:
        if not self.question.strip():
            raise ValueError(f"example {self.id!r}: empty question")
        if not self.answers or not all(isinstance(a, str) for a in self.answers):
            raise ValueError(f"example {self.id!r}: answers must be a non-empty list of str")
        if not self.passages:
            raise ValueError(f"example {self.id!r}: no passages")
