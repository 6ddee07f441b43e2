"""``blendkv bench gpu`` end to end on the CPU with the tiny shape (the GPU numbers need a GPU;
this checks the command runs, agrees with transformers and reports every figure)."""

from __future__ import annotations

import json

from blendkv.cli import main


def test_bench_gpu_tiny_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    args = ["bench", "gpu", "--shapes", "tiny", "--device", "cpu", "--dtype", "float32"]
    args += ["--prefill-tokens", "128", "--docs", "3", "--doc-tokens", "40"]
    args += ["--decode-tokens", "4", "--concurrency", "3", "--repeats", "1", "--kv-cache-gb", "1"]
    assert main([*args, "--json", str(out), "--profile", str(tmp_path / "prof")]) == 0
    (row,) = json.loads(out.read_text())
    assert row["greedy_match"] == 1.0  # fp32: blendkv's greedy tokens are transformers'
    assert row["blend_chunks_hit"] == 3  # the store was warm
    for key in ("prefill_vs_hf", "blend_speedup", "decode_vs_hf_1", "decode_vs_hf_3"):
        assert row[key] > 0
    assert "greedy match 1.00" in capsys.readouterr().out
    # --profile: one report per shape, each request's host figures (no device on the CPU)
    report = (tmp_path / "prof" / "profile_tiny.txt").read_text()
    for name in ("blend", "reuse", "full"):
        assert f"## {name}: " in report and f"### {name}: cProfile (cumulative)" in report
        assert row["profile"][name]["aten_ops"] > 0 and row["profile"][name]["wall_ms"] > 0


def test_bench_gpu_rejects_unknown_shapes(capsys):
    assert main(["bench", "gpu", "--shapes", "gpt5", "--device", "cpu"]) == 2
    assert "unknown shape" in capsys.readouterr().err


def test_count_launches_counts_the_kernels_of_each_request(tmp_path):
    """The launch counter on a 2-layer model: a full prefill launches each Triton kernel of a
    layer once per layer (the final norm once more), and a blend launches more than a reuse."""
    out = tmp_path / "launches.json"
    args = ["--layers", "2", "--docs", "2", "--doc-words", "8", "--json", str(out)]
    assert main(["bench", "launches", *args]) == 0
    rows = json.loads(out.read_text())
    full = rows["full"]["triton"]
    assert full["_rms_norm_kernel"] == 2 * 2 + 1
    assert full["_rotary_qk_kernel"] == full["_silu_and_mul_kernel"] == 2
    # the pruned last layer writes every row's K/V, then attention writes its sampled row's
    assert full["_kv_write_kernel"] == 2 + 1
    # a full prefill waits for the device once: the sampled token comes back
    (where,) = rows["full"]["syncs_at"]
    assert "sampler.py" in where and rows["full"]["host_syncs"] == 1
    assert rows["blend"]["launches"] > rows["reuse"]["launches"] > 0
    assert rows["blend"]["triton"]["_mass_kernel"] == 2  # ProphetKV's pass: every layer
