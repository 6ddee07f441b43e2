"""``blendkv bench decode`` end to end on a tiny model: the command runs, blendkv's batched
greedy tokens equal transformers' one-at-a-time ones, and every figure is reported."""

from __future__ import annotations

import json

from blendkv.cli import main


def test_bench_decode_tiny(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "decode.json"
    args = ["bench", "decode", "--model", str(tiny_llama_dir), "--num-requests", "5"]
    args += ["--output-tokens", "6", "--llama-requests", "0", "--json", str(out)]
    assert main(args) == 0
    row = json.loads(out.read_text())["decode_bench"]
    assert row["match_requests"] == 5
    for key in ("blendkv_tok_s", "blendkv_decode_tok_s", "hf_tok_s", "hf_decode_tok_s"):
        assert row[key] > 0
    assert row["llama_cpp_tok_s"] is None
    printed = capsys.readouterr().out
    assert "matches transformers on 5/5 requests" in printed
    assert "llama.cpp: skipped" in printed
