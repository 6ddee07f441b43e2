"""Paired bootstrap intervals of a journal's records (``blendkv.eval.bootstrap``) and their
wording in the report."""

from __future__ import annotations

import numpy as np
import pytest

from blendkv.eval.bootstrap import compare_methods, default_baseline, verdict
from blendkv.eval.report import format_intervals, interval_rows


def _records(values: dict[str, list[float]], metric: str = "answer_kl") -> list[dict]:
    n = len(next(iter(values.values())))
    return [
        {"id": f"ex{i}", "method": m, metric: v[i]} for i in range(n) for m, v in values.items()
    ]


def _journal(n: int = 30) -> dict[str, list[float]]:
    rng = np.random.default_rng(123)
    reuse = rng.gamma(2.0, 0.2, n)
    return {
        "reuse": list(reuse),
        "default": list(reuse * rng.uniform(0.1, 0.6, n)),
        "blend@0.05": list(reuse * rng.uniform(0.3, 1.1, n)),
    }


def test_known_interval_of_a_fixed_journal():
    values = _journal()
    rows = {r.method: r for r in compare_methods(_records(values), baseline="default")}
    # The documented procedure, written out independently: one (10000, n) index matrix from
    # default_rng(0), ratio of resampled means, percentile interval.
    x = {m: np.array(v) for m, v in values.items()}
    idx = np.random.default_rng(0).integers(0, 30, size=(10_000, 30))
    ratio = x["blend@0.05"][idx].mean(1) / x["reuse"][idx].mean(1)
    diff = x["blend@0.05"][idx].mean(1) - x["default"][idx].mean(1)
    r = rows["blend@0.05"]
    assert (r.ratio.low, r.ratio.high) == pytest.approx(tuple(np.percentile(ratio, [2.5, 97.5])))
    assert (r.diff.low, r.diff.high) == pytest.approx(tuple(np.percentile(diff, [2.5, 97.5])))
    assert r.ratio.point == pytest.approx(x["blend@0.05"].mean() / x["reuse"].mean())
    assert r.ratio.low < r.ratio.point < r.ratio.high
    assert r.wins + r.losses + r.ties == r.n == 30
    assert r.wins == int((x["blend@0.05"] < x["default"]).sum())
    assert rows["default"].verdict == "baseline"
    assert r.verdict == "worse" and rows["reuse"].verdict == "worse"


def test_closed_form_when_every_example_agrees():
    reuse = [0.2, 0.5, 1.0, 0.3, 0.8, 0.1]
    values = {"reuse": reuse, "half": [v / 2 for v in reuse], "plus": [v + 0.25 for v in reuse]}
    rows = {r.method: r for r in compare_methods(_records(values), baseline="reuse")}
    # A constant ratio or offset on every example is the same on every resample.
    assert (rows["half"].ratio.low, rows["half"].ratio.high) == pytest.approx((0.5, 0.5))
    assert (rows["plus"].diff.low, rows["plus"].diff.high) == pytest.approx((0.25, 0.25))
    assert (rows["half"].verdict, rows["plus"].verdict) == ("better", "worse")
    assert (rows["half"].wins, rows["plus"].losses) == (6, 6)


def test_identical_runs_are_not_called_different():
    values = _journal()
    values["copy"] = list(values["default"])
    rows = {r.method: r for r in compare_methods(_records(values), baseline="default")}
    copy = rows["copy"]
    assert copy.verdict == "no difference"
    assert (copy.diff.low, copy.diff.high, copy.wins, copy.losses, copy.ties) == (0, 0, 0, 0, 30)
    assert copy.ratio == rows["default"].ratio


def test_accuracy_is_higher_is_better_and_noise_is_no_difference():
    em = {"full": [1.0] * 20, "reuse": [1.0, 0.0] * 10, "default": [1.0] * 19 + [0.0]}
    rows = {r.method: r for r in compare_methods(_records(em, "em"), "em", "full", None)}
    assert rows["reuse"].verdict == "worse" and rows["reuse"].ratio is None
    assert rows["default"].verdict == "no difference"  # one example of twenty
    assert rows["default"].losses == 1


def test_only_examples_every_method_finished():
    records = _records(_journal(10)) + [{"id": "extra", "method": "reuse", "answer_kl": 9.0}]
    assert {r.n for r in compare_methods(records)} == {10}
    assert compare_methods([]) == []


def test_default_baseline_is_the_default_blend_whatever_its_name():
    assert default_baseline(["full", "reuse", "default"]) == "default"
    assert default_baseline(["full", "reuse", "target@1"]) == "target@1"  # the default target
    assert default_baseline(["full", "reuse", "target@0.5", "blend@0.1"]) is None
    assert default_baseline(["reuse[int8]", "target@1.0[int8]", "target@1.0"]) == "target@1.0"
    assert verdict(None, "answer_kl") == ""


def test_report_wording():
    values = _journal()
    records = _records(values) + [
        {"id": f"ex{i}", "method": "full", "answer_kl": 0.0} for i in range(30)
    ]
    rows = interval_rows([{**r, "em": 1.0} for r in records], None)
    assert [r.method for r in rows["answer_kl"]] == ["reuse", "default", "blend@0.05"]
    text = format_intervals(rows)
    assert "| ratio to reuse [95% CI] | diff to default [95% CI] |" in text
    assert "| reuse | 30 |" in text and "| worse |" in text and "| baseline |" in text
    assert "| no difference |" in text  # em: every method 1.0
