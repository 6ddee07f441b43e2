"""End to end: ``blendkv eval`` in-process on two synthetic examples with a tiny random Llama."""

from __future__ import annotations

import json

import pytest

from blendkv.cli import main

METHODS = [
    "full",
    "reuse",
    "blend@0.5",
    "blend@0.5:attention",
    "blend@0.5:v_deviation+c0",
    "blend@1.0",
]
SUMMARY_KEYS = {
    "n",
    "f1",
    "em",
    "rouge_l",
    "first_token_agreement",
    "first_token_kl",
    "answer_kl",
    "answer_agreement",
    "continuation_match",
    "ttft_median_s",
    "ttft_p90_s",
    "recompute_fraction",
    "compute_fraction",
    "kv_bytes_loaded",
    "load_seconds",
    "ttft_speedup",
}
RECORD_KEYS = {
    "id",
    "method",
    "prediction",
    "answers",
    "f1",
    "em",
    "rouge_l",
    "first_token_agreement",
    "first_token_kl",
    "answer_kl",
    "answer_agreement",
    "continuation_match",
    "ttft_s",
    "recompute_fraction",
    "compute_fraction",
    "kv_bytes_loaded",
    "load_seconds",
}


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory, eval_model_dir):
    out = tmp_path_factory.mktemp("eval")
    argv = ["eval", "--data", "synthetic", "--limit", "2", "--methods", ",".join(METHODS)]
    argv += ["--model", str(eval_model_dir)]
    argv += ["--dtype", "float32", "--max-tokens", "8", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    return out


def test_writes_every_output_with_documented_keys(eval_dir):
    for name in ("results.json", "per_example.jsonl", "report.md", "quality_vs_ttft.png"):
        assert (eval_dir / name).stat().st_size > 0, name
    assert (eval_dir / "recompute_sweep.png").stat().st_size > 0  # two blend@R given
    assert (eval_dir / "pareto.png").stat().st_size > 0
    results = json.loads((eval_dir / "results.json").read_text())
    assert results["config"]["methods"] == METHODS
    assert list(results["methods"]) == METHODS
    for name, summary in results["methods"].items():
        assert SUMMARY_KEYS <= set(summary), (name, SUMMARY_KEYS - set(summary))
        assert summary["n"] == 2
    records = [json.loads(line) for line in (eval_dir / "per_example.jsonl").open()]
    assert len(records) == 2 * len(METHODS)
    assert all(RECORD_KEYS <= set(r) for r in records)
    report = (eval_dir / "report.md").read_text()
    assert all(f"| {m} |" in report for m in METHODS)
    # Bootstrap intervals: no default blend in METHODS, so ratios to reuse but no baseline.
    assert "## Paired bootstrap 95 % intervals" in report
    kl_rows = {r["method"]: r for r in results["intervals"]["answer_kl"]}
    assert set(kl_rows) == set(METHODS) - {"full"}
    assert kl_rows["reuse"]["ratio"]["point"] == pytest.approx(1.0)
    assert all(r["diff"] is None and r["n"] == 2 for r in kl_rows.values())


def test_baseline_must_be_a_method(tmp_path, capsys):
    argv = ["eval", "--data", "synthetic", "--methods", "full,reuse", "--baseline", "blend@0.1"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "--baseline 'blend@0.1' is not one of --methods" in capsys.readouterr().err


def test_fidelity_orders_methods(eval_dir):
    m = json.loads((eval_dir / "results.json").read_text())["methods"]
    assert m["full"]["answer_kl"] == 0.0 and m["full"]["continuation_match"] == 1.0
    # Recomputing every token is full prefill (fp32): same logits, same greedy answer.
    assert m["blend@1.0"]["answer_kl"] < 1e-3
    assert m["blend@1.0"]["continuation_match"] == 1.0
    assert m["blend@1.0"]["recompute_fraction"] == pytest.approx(1.0)
    # Reusing chunk K/V as is loses the cross-chunk attention; some of it shows in the KL.
    assert m["reuse"]["answer_kl"] > m["blend@1.0"]["answer_kl"]
    assert m["reuse"]["recompute_fraction"] == 0.0 and m["reuse"]["kv_bytes_loaded"] > 0
    # Another selection strategy recomputes as many tokens, picked by the query's attention.
    assert m["blend@0.5:attention"]["recompute_fraction"] == pytest.approx(0.5, abs=0.02)


def test_bad_method_fails_before_loading(tmp_path, capsys):
    argv = ["eval", "--data", "synthetic", "--methods", "blend@2", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "recompute ratio 2.0 is not in [0, 1]" in capsys.readouterr().err


def test_every_chunk_is_a_hit_when_the_store_cannot_hold_the_run(
    eval_dir, eval_model_dir, tmp_path, monkeypatch
):
    """The run's private store is bounded (a few GB for real runs): bounded here to about one
    example's chunks, every timed request still finds its chunks stored (each example's are
    stored just before it runs), so no chunk precompute lands in a method's TTFT."""
    from blendkv.connector import manager

    records = [json.loads(line) for line in (eval_dir / "per_example.jsonl").open()]
    sizes = [r["kv_bytes_loaded"] for r in records if r["method"] == "reuse"]
    assert len(sizes) == 2 and min(sizes) > 0
    # One example's chunks plus the file's own pages: the reserve of free pages a bounded store
    # keeps (capacity.MIN_FREE_PAGES), LMDB's meta and B-tree pages, each value's last page.
    bound = max(sizes) + 100 * 4096
    assert bound < sum(sizes)  # both examples' chunks do not fit
    monkeypatch.setattr(manager, "default_request_cache_bytes", lambda path: bound)
    out = tmp_path / "bounded"
    argv = ["eval", "--data", "synthetic", "--limit", "2", "--methods", "full,reuse,blend@0.5"]
    argv += ["--model", str(eval_model_dir)]
    argv += ["--dtype", "float32", "--max-tokens", "4", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    blended = [json.loads(line) for line in (out / "per_example.jsonl").open()]
    blended = [r for r in blended if r["blend_stats"] is not None]
    assert len(blended) == 4
    for r in blended:
        stats = r["blend_stats"]
        assert stats["chunks_missed"] == 0 and stats["chunks_hit"] == stats["num_chunks"], r["id"]
