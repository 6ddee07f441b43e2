"""``blendkv bench threads`` end to end on a tiny model: every wait setting runs in its own
process, alone and beside a busy one, with the same greedy tokens, and every figure is
reported against libgomp's default."""

from __future__ import annotations

import json

from blendkv.cli import main


def test_bench_threads_tiny(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "threads.json"
    args = ["bench", "threads", "--model", str(tiny_llama_dir), "--dtype", "float32"]
    args += ["--prefill-tokens", "48", "--num-requests", "2", "--output-tokens", "3"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens_equal"]
    rows = {(r["load"], r["setting"]): r for r in result["threads_bench"]}
    assert set(rows) == {
        (load, setting)
        for load in ("alone", "beside a busy process")
        for setting in ("blendkv", "libgomp", "passive")
    }
    for row in rows.values():
        assert row["prefill_s"] > 0 and row["decode1_tok_s"] > 0 and row["decode2_tok_s"] > 0
    for load in ("alone", "beside a busy process"):
        assert rows[(load, "libgomp")]["decode1_vs_libgomp"] == 1.0
    assert "beside a busy process" in capsys.readouterr().out
