"""End to end: ``blendkv eval`` reports each method against a fidelity target (the share of
examples within it, how often the greedy answer differs from full prefill's) and the ratio each
blend ran at, on two synthetic examples with a tiny random Llama."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest

from blendkv.cli import main
from blendkv.errors import ConfigError
from blendkv.eval.datasets import load_dataset
from blendkv.eval.methods import parse_method
from blendkv.eval.runner import REPORT_TARGET, EvalConfig
from blendkv.guards.calibration import UNCALIBRATED_RATIO

METHODS = ["full", "blend@0.2", "target@0.5"]


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory, eval_model_dir):
    out = tmp_path_factory.mktemp("eval-target")
    argv = ["eval", "--data", "synthetic", "--limit", "2", "--methods", ",".join(METHODS)]
    argv += ["--model", str(eval_model_dir), "--fidelity-target", "0"]
    argv += ["--dtype", "float32", "--max-tokens", "8", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    return out


def _results(out):
    return json.loads((out / "results.json").read_text())["methods"]


def _records(out):
    return [json.loads(line) for line in (out / "per_example.jsonl").open()]


def test_within_target_and_greedy_differs_per_method(eval_dir):
    m = _results(eval_dir)
    assert list(m) == METHODS
    for name, s in m.items():
        assert s["fidelity_target"] == 0.0, name  # --fidelity-target holds every method to it
        assert 0.0 <= s["within_target"] <= 1.0 and 0.0 <= s["greedy_differs"] <= 1.0
    # Full prefill is its own reference: its divergence is exactly 0, within even a 0 target.
    assert m["full"]["within_target"] == 1.0 and m["full"]["greedy_differs"] == 0.0
    records = _records(eval_dir)
    for name in METHODS:
        rows = [r for r in records if r["method"] == name]
        within = sum(r["answer_max_kl"] <= 0.0 for r in rows) / len(rows)
        assert m[name]["within_target"] == pytest.approx(within)
        differs = sum(r["continuation_match"] == 0.0 for r in rows) / len(rows)
        assert m[name]["greedy_differs"] == pytest.approx(differs)
    # A random model's blend drifts somewhere: the largest row KL is at least the mean.
    for r in records:
        assert r["answer_max_kl"] >= r["answer_kl"] - 1e-12
    assert any(r["answer_max_kl"] > 0.0 for r in records if r["method"] == "blend@0.2")
    report = (eval_dir / "report.md").read_text()
    assert "within target" in report and "greedy differs" in report


def test_the_ratio_each_blend_ran_at_is_in_every_record(eval_dir):
    ratios = {(r["method"], r["id"]): r["recompute_ratio"] for r in _records(eval_dir)}
    assert len(ratios) == 2 * len(METHODS)
    for (method, _), ratio in ratios.items():
        # No calibration beside the run's private store: a target runs the conservative ratio.
        want = {"full": None, "blend@0.2": 0.2, "target@0.5": UNCALIBRATED_RATIO}[method]
        assert ratio == want, method
    stats = [r["blend_stats"] for r in _records(eval_dir) if r["method"] == "target@0.5"]
    assert all(s["fidelity_target"] == 0.5 and s["calibrated"] is False for s in stats)


def test_tradeoff_plot_is_written(eval_dir):
    assert (eval_dir / "tradeoff.png").stat().st_size > 0


def test_without_the_option_a_target_method_is_held_to_its_own(eval_dir, eval_model_dir, tmp_path):
    """``--resume`` with every example journaled re-aggregates without the model: the same
    records, held to the default targets."""
    out = tmp_path / "again"
    shutil.copytree(eval_dir, out)
    argv = ["eval", "--data", "synthetic", "--limit", "2", "--methods", ",".join(METHODS)]
    argv += ["--model", str(eval_model_dir), "--resume"]
    argv += ["--dtype", "float32", "--max-tokens", "8", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    m = _results(out)
    assert m["target@0.5"]["fidelity_target"] == 0.5
    assert m["blend@0.2"]["fidelity_target"] == m["full"]["fidelity_target"] == REPORT_TARGET
    records = _records(out)
    for name, s in m.items():
        rows = [r for r in records if r["method"] == name]
        within = sum(r["answer_max_kl"] <= s["fidelity_target"] for r in rows) / len(rows)
        assert s["within_target"] == pytest.approx(within)


def test_target_for():
    config = EvalConfig(data="synthetic", methods="full,blend@0.2,target@0.3")
    targets = {m.name: config.target_for(m) for m in config.method_list}
    assert targets == {"full": REPORT_TARGET, "blend@0.2": REPORT_TARGET, "target@0.3": 0.3}
    config = EvalConfig(data="synthetic", methods="target@0.3", fidelity_target=1.5)
    assert config.target_for(parse_method("target@0.3")) == 1.5
    for bad in (-1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="fidelity_target"):
            EvalConfig(data="synthetic", fidelity_target=bad)


def test_calibrate_first_then_targets_run_at_the_calibrated_ratio(tmp_path, eval_model_dir, capsys):
    """``--calibrate 2``: the run's store is calibrated before the methods run (the curve goes
    in results.json and beside the store), and a target's records ran at the ratio the curve
    picks, marked calibrated. Two prompts are too few to bound a 90th percentile: it says so."""
    out, store = tmp_path / "out", tmp_path / "store"
    argv = ["eval", "--data", "synthetic", "--limit", "2", "--methods", "full,target@0.5"]
    argv += ["--model", str(eval_model_dir), "--calibrate", "2", "--kv-store-dir", str(store)]
    argv += ["--dtype", "float32", "--max-tokens", "4", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "the largest of 2 prompts bounds the p90 with 19% confidence" in capsys.readouterr().err
    curve = json.loads((out / "results.json").read_text())["config"]["calibration"]
    assert curve["num_prompts"] == 2 and list(curve["ratios"]) == [0.0, 0.05, 0.1, 0.2, 0.3, 0.5]
    passages = [len(ex.passages) for ex in load_dataset("synthetic", 2, 0, 0)]
    assert curve["chunks_per_prompt"] == round(statistics.median(passages))  # prompts as long
    assert (store / "calibration.json").exists()
    high = dict(zip(curve["ratios"], curve["high"], strict=True))
    picked = min((r for r, h in high.items() if h <= 0.5), default=1.0)
    rows = [r for r in _records(out) if r["method"] == "target@0.5"]
    assert rows and all(r["blend_stats"]["calibrated"] for r in rows)
    assert all(r["blend_stats"]["predicted_recompute_ratio"] == picked for r in rows)


def test_an_uncalibrated_store_is_named_for_the_default(tmp_path, eval_model_dir, capsys):
    argv = ["eval", "--data", "synthetic", "--limit", "1", "--methods", "full,default"]
    argv += ["--model", str(eval_model_dir), "--kv-store-dir", str(tmp_path / "store")]
    argv += ["--dtype", "float32", "--max-tokens", "2", "--out", str(tmp_path / "out")]
    assert main([*argv, "--no-progress"]) == 0
    assert "no calibration: default run at ratio 0.3" in capsys.readouterr().err
    rows = [r for r in _records(tmp_path / "out") if r["method"] == "default"]
    assert rows and rows[0]["recompute_ratio"] == UNCALIBRATED_RATIO


def test_a_resumed_run_keeps_its_calibration(tmp_path, eval_model_dir, capsys):
    """``--resume`` after a calibrated run: the curve beside the store is the one the first
    examples ran with, so it is kept, not measured again on the examples still to run; the
    journal has it. A resume with another ``--calibrate`` is refused."""
    out, store = tmp_path / "out", tmp_path / "store"
    argv = ["eval", "--data", "synthetic", "--methods", "full,target@0.5", "--calibrate", "2"]
    argv += ["--model", str(eval_model_dir), "--kv-store-dir", str(store), "--dtype", "float32"]
    argv += ["--max-tokens", "4", "--out", str(out), "--no-progress"]
    assert main([*argv, "--limit", "1"]) == 0
    saved = (store / "calibration.json").read_text()
    first = json.loads((out / "run_config.json").read_text())["config"]["calibration"]
    assert main([*argv, "--limit", "2", "--resume"]) == 0
    assert (store / "calibration.json").read_text() == saved  # not measured again
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["calibration"] == first
    assert results["config"]["num_examples"] == 2
    rows = [r for r in _records(out) if r["method"] == "target@0.5"]
    assert len(rows) == 2 and all(r["blend_stats"]["calibrated"] for r in rows)
    other = [a if a != "2" else "3" for a in argv]
    assert main([*other, "--limit", "2", "--resume"]) == 2
    assert "calibrate: 2 there, 3 now" in capsys.readouterr().err


def test_calibrate_takes_zero_or_at_least_two_prompts():
    with pytest.raises(ConfigError, match="calibrate"):
        EvalConfig(data="synthetic", calibrate=1)
    assert EvalConfig(data="synthetic", calibrate=0).calibrate == 0


def test_calibrate_on_questions_measures_the_examples_own_prompts(tmp_path, eval_model_dir):
    """``--calibrate-on questions``: the first N examples' own prompts, each with its question
    (a sample of traffic), not random passage sets with generic questions: another curve."""
    curves = {}
    for mode in ("passages", "questions"):
        out, store = tmp_path / mode, tmp_path / f"store-{mode}"
        argv = ["eval", "--data", "synthetic", "--limit", "2", "--methods", "full,target@0.5"]
        argv += ["--model", str(eval_model_dir), "--calibrate", "2", "--calibrate-on", mode]
        argv += ["--kv-store-dir", str(store), "--dtype", "float32", "--max-tokens", "4"]
        assert main([*argv, "--out", str(out), "--no-progress"]) == 0
        config = json.loads((out / "results.json").read_text())["config"]
        assert config["calibrate_on"] == mode and config["calibration"]["num_prompts"] == 2
        curves[mode] = config["calibration"]["divergence"]
    assert curves["passages"] != curves["questions"]
    with pytest.raises(ConfigError, match="calibrate_on must be one of passages, questions"):
        EvalConfig(data="synthetic", methods="full", calibrate_on="log")
