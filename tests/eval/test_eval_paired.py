"""``python -m blendkv.eval.paired``: per-example pairing of two runs' records."""

from __future__ import annotations

import json

import pytest

from blendkv.eval.paired import compare, load_records, main, sign_test


def _write(path, rows):
    path.mkdir()
    lines = [json.dumps({"id": i, "method": m, "answer_kl": kl}) for i, m, kl in rows]
    (path / "per_example.jsonl").write_text("\n".join(lines) + "\n")


def test_pairs_only_examples_both_runs_finished(tmp_path, capsys):
    _write(
        tmp_path / "base",
        [
            ("a", "full", 0.0),
            ("a", "reuse", 0.4),
            ("b", "reuse", 0.2),
            ("c", "reuse", 9.0),
        ],
    )
    _write(tmp_path / "run", [("a", "full", 0.0), ("a", "reuse", 0.1), ("b", "reuse", 0.3)])
    rows = compare(load_records(tmp_path / "base"), load_records(tmp_path / "run"), "answer_kl")
    assert rows == [
        {
            "method": "reuse",
            "n": 2,
            "mean": pytest.approx(0.2),
            "base_mean": pytest.approx(0.3),
            "lower": 1,
            "higher": 1,
            "p": 1.0,
            "diff_low": pytest.approx(-0.3),
            "diff_high": pytest.approx(0.1),
            "called": "no difference",
        },
    ]
    assert main([str(tmp_path / "base"), f"x={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert (
        "| x | reuse | 2 | 0.2000 | 0.3000 | 0.67x | 1/2 | 1/2 | 1.000 | [-0.3000, +0.1000] " in out
    )
    assert "| full |" not in out
    assert main([str(tmp_path / "base"), f"x={tmp_path / 'run'}", "--with-full"]) == 0
    assert (
        "| x | full | 1 | 0.0000 | 0.0000 | nanx | 0/1 | 0/1 | 1.000 |" in capsys.readouterr().out
    )


def test_sign_test_is_exact_and_two_sided():
    assert sign_test(0, 0) == 1.0
    assert sign_test(0, 5) == sign_test(5, 0) == pytest.approx(2 / 32)
    assert sign_test(1, 9) == pytest.approx(2 * 11 / 1024)
    assert sign_test(3, 3) == 1.0


def test_identical_runs_are_not_called_different(tmp_path):
    rows = [(str(i), "reuse", 0.1 * (i % 7)) for i in range(40)]
    _write(tmp_path / "base", rows)
    _write(tmp_path / "same", rows)
    [row] = compare(load_records(tmp_path / "base"), load_records(tmp_path / "same"), "answer_kl")
    assert (row["diff_low"], row["diff_high"], row["called"]) == (0.0, 0.0, "no difference")
    _write(tmp_path / "lower", [(i, m, kl - 0.05 - 0.01 * (int(i) % 3)) for i, m, kl in rows])
    [row] = compare(load_records(tmp_path / "base"), load_records(tmp_path / "lower"), "answer_kl")
    assert row["called"] == "lower" and row["diff_high"] < 0
