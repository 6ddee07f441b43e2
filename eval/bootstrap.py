"""Paired bootstrap intervals of an evaluation's per-example records, so methods rank with
confidence rather than by means of a few dozen examples.

Every resample draws ``n`` examples with replacement (one index matrix, seeded, shared by every
method, so all statistics are paired on the same examples). For each method:

- ``ratio``: its mean metric over the reference's (``reuse``) mean on the same resampled
  examples (a ratio of means, not a mean of ratios: KL is often ~0 on single examples);
- ``diff``: the mean per-example difference to a named baseline (default: the default blend);
- ``wins``/``losses``/``ties`` against the baseline, on the examples themselves.

Intervals are percentile intervals (the ``alpha/2`` and ``1 - alpha/2`` quantiles of the
resampled statistic, numpy's default linear interpolation), not BCa. A method is called
better or worse than the baseline only when the difference's interval excludes 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "LOWER_IS_BETTER",
    "Interval",
    "MethodComparison",
    "bootstrap_indices",
    "compare_methods",
    "default_baseline",
    "verdict",
]

RESAMPLES = 10_000
SEED = 0
LEVEL = 0.95
# Metrics where lower is better (fidelity losses); every other metric is higher-is-better.
LOWER_IS_BETTER = frozenset({"answer_kl", "first_token_kl", "ttft_s"})


@dataclass(frozen=True)
class Interval:
    """A point estimate on the examples and its bootstrap interval ``[low, high]``."""

    point: float
    low: float
    high: float

    def excludes(self, value: float) -> bool:
        return self.low > value or self.high < value


@dataclass(frozen=True)
class MethodComparison:
    """One method's paired statistics over ``n`` examples (see the module docstring)."""

    method: str
    metric: str
    n: int
    mean: float
    ratio: Interval | None  # to the reference; None without one or when its mean is 0
    diff: Interval | None  # method - baseline; None without a baseline
    wins: int  # examples where the method beats the baseline
    losses: int
    ties: int
    verdict: str  # "better", "worse", "no difference" or "baseline"/"" (see verdict())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bootstrap_indices(n: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """``(resamples, n)`` example indices drawn with replacement by ``default_rng(seed)``."""
    assert n > 0 and resamples > 0
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _percentile(stats: np.ndarray, point: float, level: float) -> Interval:
    alpha = 1.0 - level
    low, high = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
    return Interval(float(point), float(low), float(high))


def verdict(diff: Interval | None, metric: str) -> str:
    """``better``/``worse`` only when the difference's interval excludes 0, else ``no
    difference`` (``""`` without a baseline)."""
    if diff is None:
        return ""
    if not diff.excludes(0.0):
        return "no difference"
    lower = diff.high < 0.0
    return "better" if lower == (metric in LOWER_IS_BETTER) else "worse"


def default_baseline(methods: list[str]) -> str | None:
    """The run's method that is ``BlendConfig()``'s blend (whatever its name), or None."""
    from blendkv.eval.methods import MethodError, _identity, parse_method

    want = _identity(parse_method("default"))  # a target@T at the default target is the same
    for m in sorted(methods, key=lambda m: "[" in m):  # none's rows before --kv-codec's
        try:
            if _identity(parse_method(m)) == want:
                return m
        except MethodError:  # a row name that is no method
            continue
    return None


def compare_methods(
    records: list[dict[str, Any]],
    metric: str = "answer_kl",
    baseline: str | None = None,
    reference: str | None = "reuse",
    resamples: int = RESAMPLES,
    seed: int = SEED,
    level: float = LEVEL,
) -> list[MethodComparison]:
    """One row per method of ``records`` (in first-seen order), over the examples every method
    finished. ``baseline``/``reference`` absent from the records leave ``diff``/``ratio`` None."""
    records = [r for r in records if "id" in r]  # only records of an example pair
    methods = list(dict.fromkeys(r["method"] for r in records))
    values: dict[str, dict[str, float]] = {m: {} for m in methods}
    for r in records:
        if r.get(metric) is not None:
            values[r["method"]][r["id"]] = float(r[metric])
    ids = [
        i for i in dict.fromkeys(r["id"] for r in records) if all(i in values[m] for m in methods)
    ]
    if not ids:
        return []
    x = {m: np.array([values[m][i] for i in ids]) for m in methods}
    idx = bootstrap_indices(len(ids), resamples, seed)
    means = {m: x[m][idx].mean(axis=1) for m in methods}  # (resamples,) per method
    ref = reference if reference in x else None
    base = baseline if baseline in x else None
    rows = []
    for m in methods:
        ratio = None
        if ref is not None and x[ref].mean() > 0 and (means[ref] > 0).all():
            ratio = _percentile(means[m] / means[ref], x[m].mean() / x[ref].mean(), level)
        diff = None
        wins = losses = ties = 0
        if base is not None:
            d = x[m] - x[base]
            diff = _percentile(means[m] - means[base], d.mean(), level)
            better = d < 0 if metric in LOWER_IS_BETTER else d > 0
            wins, ties = int(better.sum()), int((d == 0).sum())
            losses = len(ids) - wins - ties
        rows.append(
            MethodComparison(
                m,
                metric,
                len(ids),
                float(x[m].mean()),
                ratio,
                diff,
                wins,
                losses,
                ties,
                "baseline" if m == base else verdict(diff, metric),
            )
        )
    return rows
