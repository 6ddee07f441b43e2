"""``blendkv bench plot`` redraws the benchmarks page's plots from saved result files."""

from __future__ import annotations

import json

import pytest

from blendkv.cli import main


def _method(kl: float, ttft: float) -> dict:
    return {"answer_kl": kl, "ttft_median_s": ttft, "f1": 0.3}


def test_plots_from_an_eval_run_and_a_bench_file(tmp_path):
    run = tmp_path / "smollm2_sweep"
    run.mkdir()
    methods = {
        "full": _method(0.0, 4.0),
        "reuse": _method(0.09, 0.2),
        "blend@0.1:prophet": _method(0.03, 0.8),
        "blend@0.3:prophet": _method(0.01, 1.5),
    }
    (run / "results.json").write_text(json.dumps({"config": {}, "methods": methods}))
    sizes = [
        {"tokens": t, "full_s": t / 1e3, "blend_s": t / 5e3, "reuse_s": t / 2e4}
        for t in (1024, 6144)
    ]
    bench = tmp_path / "cpu.json"
    bench.write_text(json.dumps([{"shape": "x", "dtype": "bf16", "device": "cpu", "blend": sizes}]))
    out = tmp_path / "plots"
    assert main(["bench", "plot", "--eval", str(run), "--ttft", str(bench), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "cpu_ttft_vs_length.png",
        "smollm2_sweep_pareto.png",
        "smollm2_sweep_recompute_sweep.png",
    ]
    assert all((out / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    with pytest.raises(SystemExit, match="nothing to plot"):
        main(["bench", "plot", "--out", str(out)])


def test_a_run_measured_against_a_target_gets_its_tradeoff_plot(tmp_path):
    run = tmp_path / "targets"
    run.mkdir()
    point = lambda within, speedup, target: {  # noqa: E731
        **_method(0.02, 1.0),
        "within_target": within,
        "ttft_speedup": speedup,
        "fidelity_target": target,
    }
    methods = {
        "full": point(1.0, 1.0, 0.5),
        "blend@0.2": point(0.92, 3.1, 0.5),
        "target@0.5": point(0.92, 3.2, 0.5),
    }
    (run / "results.json").write_text(json.dumps({"config": {}, "methods": methods}))
    out = tmp_path / "plots"
    assert main(["bench", "plot", "--eval", str(run), "--out", str(out)]) == 0
    assert "targets_tradeoff.png" in {p.name for p in out.iterdir()}
    assert (out / "targets_tradeoff.png").read_bytes()[:4] == b"\x89PNG"
