"""Answer quality (SQuAD EM/F1, Rouge-L) and fidelity to full prefill (KL, top-1 agreement).

Quality metrics follow the SQuAD v1.1/v2.0 evaluation script: answers are normalised
(lowercase, punctuation and the articles a/an/the removed, whitespace collapsed), F1 is over
whitespace tokens of the normalised strings, and a prediction's score is the max over gold
answers. CacheBlend's reference script counts F1 over *model-tokenizer* tokens instead; we use
words so scores do not depend on the model being evaluated. Rouge-L comes from ``rouge-score``.

Fidelity metrics compare a method's logits with full prefill's logits for the same prompt
(and, teacher-forced, along full prefill's answer tokens); they live in
:mod:`blendkv.guards.fidelity` (``ask --compare-full`` uses them too) and are re-exported here.
All functions are deterministic.
"""

from __future__ import annotations

import collections
import functools
import re
import string
from collections.abc import Iterable, Sequence

import numpy as np

from blendkv.guards.fidelity import (
    Fidelity,
    answer_divergence,
    first_token_agreement,
    kl_divergence,
    teacher_forced_fidelity,
)

__all__ = [
    "Fidelity",
    "answer_divergence",
    "exact_match",
    "f1_score",
    "first_line",
    "first_token_agreement",
    "kl_divergence",
    "normalize_answer",
    "rouge_l",
    "summarize",
    "teacher_forced_fidelity",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop a/an/the, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def first_line(generation: str) -> str:
    """The first non-blank line of a generation, stripped (models often add text after the
    answer; CacheBlend's scripts score only the first line)."""
    for line in generation.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _golds(golds: str | Sequence[str]) -> list[str]:
    golds = [golds] if isinstance(golds, str) else list(golds)
    if not golds:
        raise ValueError("golds must hold at least one gold answer")
    return golds


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(golds)))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        # SQuAD v2: a no-answer scores 1 only against a no-answer.
        return float(pred_tokens == gold_tokens)
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: str | Sequence[str]) -> float:
    """SQuAD token F1 of the normalised prediction, max over gold answers."""
    pred = normalize_answer(prediction).split()
    return max(_f1(pred, normalize_answer(g).split()) for g in _golds(golds))


@functools.lru_cache(maxsize=2)
def _rouge_scorer(use_stemmer: bool):
    # Imported lazily: rouge-score is an optional (eval) dependency.
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)


def rouge_l(prediction: str, golds: str | Sequence[str], *, use_stemmer: bool = True) -> float:
    """Rouge-L F-measure (``rouge-score``), max over gold answers.

    ``use_stemmer=True`` matches CacheBlend's and LongBench's scripts. rouge-score tokenises by
    lowercasing and keeping ``[a-z0-9]`` runs; an empty prediction or gold scores 0.
    """
    scorer = _rouge_scorer(use_stemmer)
    return max(scorer.score(g, prediction)["rougeL"].fmeasure for g in _golds(golds))


# ----------------------------------------------------------------------------- aggregation


def summarize(values: Iterable[float]) -> dict[str, float]:
    """``{"mean", "median", "p90"}`` of the values, as Python floats.

    Percentiles use numpy's default ``"linear"`` method: p90 = ``v[k] + f * (v[k+1] - v[k])``
    on the sorted values with ``k + f = 0.9 * (n - 1)``. Raises ``ValueError`` when empty.
    """
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("summarize needs a non-empty flat sequence of numbers")
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p90": float(np.percentile(arr, 90, method="linear")),
    }
