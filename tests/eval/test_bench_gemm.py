"""``blendkv bench gemm``: runs at a model's shapes and checks results first."""

from __future__ import annotations

import json

from blendkv.cli import main


def test_bench_gemm_on_the_tiny_model(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "gemm.json"
    args = ["--model", str(tiny_llama_dir), "--rows", "1,3", "--repeats", "1", "--json", str(out)]
    rc = main(["bench", "gemm", *args])
    assert rc == 0
    rows = json.loads(out.read_text())["gemm_bench"]
    # 5 maps x 2 batch sizes x 2 dtypes, each timed by F.linear at least
    assert len(rows) == 20 and all(r["F.linear"] > 0 for r in rows)
    assert {r["map"] for r in rows} == {"q/k/v", "o_proj", "gate/up", "down", "lm_head"}
    assert "lm_head" in capsys.readouterr().out
