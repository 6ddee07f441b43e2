"""``blendkv eval`` journals finished examples; ``--resume`` continues an interrupted run."""

from __future__ import annotations

import json

import pytest

from blendkv.cli import main
from blendkv.eval.journal import Journal, JournalError

ARGS = ["eval", "--data", "synthetic", "--methods", "full,reuse", "--dtype", "float32"]
ARGS += ["--max-tokens", "4", "--no-progress"]
SETTINGS = dict(
    data="synthetic", methods="full,reuse", model=None, dtype="float32", max_tokens=4, seed=0,
    answer_tokens=16, max_model_len=None,
)  # fmt: skip


def _records(out):
    return [json.loads(line) for line in (out / "per_example.jsonl").open()]


def test_resume_keeps_finished_examples_and_runs_the_rest(tmp_path):
    out = str(tmp_path)
    assert main([*ARGS, "--limit", "1", "--out", out]) == 0
    first = _records(tmp_path)
    assert len(first) == 2
    assert main([*ARGS, "--limit", "2", "--out", out, "--resume"]) == 0
    both = _records(tmp_path)
    assert both[:2] == first  # kept as measured, not rerun
    assert len(both) == 4 and len({r["id"] for r in both}) == 2
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["methods"]["reuse"]["n"] == 2
    assert results["config"]["num_examples"] == 2
    # Everything journaled: aggregates again without running anything.
    assert main([*ARGS, "--limit", "2", "--out", out, "--resume"]) == 0
    assert _records(tmp_path) == both
    # Other settings cannot resume this journal; the journal is left as it was.
    assert main([*ARGS, "--limit", "2", "--out", out, "--resume", "--max-tokens", "5"]) == 2
    assert _records(tmp_path) == both


def test_journal_drops_a_cut_example_and_a_torn_last_line(tmp_path):
    journal = Journal(tmp_path, SETTINGS, ["full", "reuse"], resume=False)
    journal.start({"model_name": "m"})
    journal.append([{"id": "a", "method": "full"}, {"id": "a", "method": "reuse"}])
    with (tmp_path / "per_example.jsonl").open("a") as f:
        f.write(json.dumps({"id": "b", "method": "full"}) + "\n")  # killed before b's reuse
        f.write('{"id": "b", "meth')  # and mid-line
    again = Journal(tmp_path, SETTINGS, ["full", "reuse"], resume=True)
    assert again.done_ids == {"a"} and again.run_config == {"model_name": "m"}
    assert [r["id"] for r in _records(tmp_path)] == ["a", "a"]
    # Without --resume the journal starts empty.
    assert Journal(tmp_path, SETTINGS, ["full", "reuse"], resume=False).records == []
    assert _records(tmp_path) == []


def test_journal_refuses_other_settings_and_damage_in_the_middle(tmp_path):
    journal = Journal(tmp_path, SETTINGS, ["full"], resume=False)
    journal.start({})
    with pytest.raises(JournalError, match=r"dtype: 'float32' there, 'bfloat16' now"):
        Journal(tmp_path, {**SETTINGS, "dtype": "bfloat16"}, ["full"], resume=True)
    (tmp_path / "per_example.jsonl").write_text('{"id": "a", "met\n{"id": "b", "method": "full"}\n')
    with pytest.raises(JournalError, match=r"per_example.jsonl:1 is not valid JSON"):
        Journal(tmp_path, SETTINGS, ["full"], resume=True)
