"""``python -m blendkv.eval.paired``: per-example pairing of two runs' records."""

from __future__ import annotations

import json

import pytest

from blendkv.eval.paired import compare, load_records, main


def _write(path, rows):
    path.mkdir()
    lines = [json.dumps({"id": i, "method": m, "answer_kl": kl}) for i, m, kl in rows]
    (path / "per_example.jsonl").write_text("\n".join(lines) + "\n")


def test_pairs_only_examples_both_runs_finished(tmp_path, capsys):
    _write(tmp_path / "base", [
        ("a", "full", 0.0), ("a", "reuse", 0.4), ("b", "reuse", 0.2), ("c", "reuse", 9.0),
    ])  # fmt: skip
    _write(tmp_path / "run", [("a", "full", 0.0), ("a", "reuse", 0.1), ("b", "reuse", 0.3)])
    rows = compare(load_records(tmp_path / "base"), load_records(tmp_path / "run"), "answer_kl")
    assert rows == [
        {"method": "reuse", "n": 2, "mean": pytest.approx(0.2), "base_mean": pytest.approx(0.3),
         "lower": 1},
    ]  # fmt: skip
    assert main([str(tmp_path / "base"), f"x={tmp_path / 'run'}"]) == 0
    assert "| x | reuse | 2 | 0.2000 | 0.3000 | 0.67x | 1/2 |" in capsys.readouterr().out
