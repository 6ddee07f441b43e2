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
    assert main([*args, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["greedy_match"] == 1.0  # fp32: blendkv's greedy tokens are transformers'
    assert row["blend_chunks_hit"] == 3  # the store was warm
    for key in ("prefill_vs_hf", "blend_speedup", "decode_vs_hf_1", "decode_vs_hf_3"):
        assert row[key] > 0
    assert "greedy match 1.00" in capsys.readouterr().out


def test_bench_gpu_rejects_unknown_shapes(capsys):
    assert main(["bench", "gpu", "--shapes", "gpt5", "--device", "cpu"]) == 2
    assert "unknown shape" in capsys.readouterr().err
