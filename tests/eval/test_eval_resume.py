"""``blendkv eval`` journals finished examples; ``--resume`` continues an interrupted run."""

from __future__ import annotations

import json

import pytest

from blendkv.cli import main
from blendkv.errors import ConfigError
from blendkv.eval.journal import Journal, JournalError
from blendkv.eval.runner import EvalConfig

ARGS = ["eval", "--data", "synthetic", "--methods", "full,reuse", "--dtype", "float32"]
ARGS += ["--max-tokens", "4", "--no-progress"]
SETTINGS = dict(
    data="synthetic",
    methods="full,reuse",
    model=None,
    dtype="float32",
    max_tokens=4,
    seed=0,
    answer_tokens=16,
    max_model_len=None,
    anchor="prompt",
    anchor_boundary=0,
    chunk_order="source",
    calibrate=0,
    calibrate_on="passages",
)


def _records(out):
    return [json.loads(line) for line in (out / "per_example.jsonl").open()]


def test_resume_keeps_finished_examples_and_runs_the_rest(eval_model_dir, tmp_path):
    args = [*ARGS, "--model", str(eval_model_dir)]
    out = str(tmp_path)
    assert main([*args, "--limit", "1", "--out", out]) == 0
    first = _records(tmp_path)
    assert len(first) == 2
    assert main([*args, "--limit", "2", "--out", out, "--resume"]) == 0
    both = _records(tmp_path)
    assert both[:2] == first  # kept as measured, not rerun
    assert len(both) == 4 and len({r["id"] for r in both}) == 2
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["methods"]["reuse"]["n"] == 2
    assert results["config"]["num_examples"] == 2
    # Everything journaled: aggregates again without running anything.
    assert main([*args, "--limit", "2", "--out", out, "--resume"]) == 0
    assert _records(tmp_path) == both
    # Other settings cannot resume this journal; the journal is left as it was.
    assert main([*args, "--limit", "2", "--out", out, "--resume", "--max-tokens", "5"]) == 2
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


def test_journal_from_before_the_anchor_settings_resumes_with_the_default_anchor(tmp_path):
    journal = Journal(tmp_path, SETTINGS, ["full"], resume=False)
    journal.start({})
    path = tmp_path / "run_config.json"
    doc = json.loads(path.read_text())
    del doc["settings"]["anchor"], doc["settings"]["anchor_boundary"]
    path.write_text(json.dumps(doc))
    assert Journal(tmp_path, SETTINGS, ["full"], resume=True).records == []
    with pytest.raises(JournalError, match=r"anchor: 'prompt' there, 'template' now"):
        Journal(tmp_path, {**SETTINGS, "anchor": "template"}, ["full"], resume=True)


def test_anchor_options_change_what_chunks_were_precomputed_behind(eval_model_dir, tmp_path):
    """Reuse's K/V comes from chunks precomputed behind the anchor asked for: another anchor,
    another reuse error; full prefill does not depend on it."""
    kls = {}
    for anchor in (["--anchor", "prompt"], ["--anchor", "template", "--anchor-boundary", "4"]):
        out = tmp_path / anchor[1]
        args = [*ARGS, "--model", str(eval_model_dir), "--limit", "1", "--out", str(out)]
        assert main([*args, *anchor]) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["config"]["anchor"] == anchor[1]
        kls[anchor[1]] = {r["method"]: r["answer_kl"] for r in _records(out)}
    assert kls["prompt"]["full"] == kls["template"]["full"] == 0.0
    assert kls["prompt"]["reuse"] != pytest.approx(kls["template"]["reuse"], rel=1e-3)
    with pytest.raises(ConfigError, match="anchor must be one of"):
        EvalConfig(data="synthetic", anchor="nowhere")
    with pytest.raises(ConfigError, match="anchor_boundary must be >= 0"):
        EvalConfig(data="synthetic", anchor_boundary=-1)
