"""``blendkv bench blend --profile`` on a tiny model: every part is reported and they add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_tiny_model_dir

from blendkv.cli import main

DATA = Path(__file__).parents[1] / "data" / "musique_dev_first2.json"


@pytest.mark.parametrize("selection", [None, "v_deviation"])  # None: the default, prophet
def test_profile_parts_add_up_to_the_ttft(tmp_path, capsys, selection):
    # The tiny byte-level tokenizer turns a MuSiQue prompt into ~10K tokens.
    model = make_tiny_model_dir(tmp_path / "model", "llama", max_position_embeddings=16384)
    out = tmp_path / "blend.json"
    args = ["bench", "blend", "--model", str(model), "--data", str(DATA)]
    if selection:
        args += ["--selection", selection, "--ratio", "0.15"]
    else:
        args += ["--repeats", "2"]  # two interleaved TTFTs per method: their median
    assert main([*args, "--limit", "1", "--dtype", "float32", "--profile", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    prof = row["profile"]
    parts = prof["parts"]
    for name in ("store reads", "selection", "K/V correction", "sampling", "python + scheduling"):
        assert name in parts
    assert any(k.startswith("recomputed layers: attention") for k in parts)
    assert sum(parts.values()) == pytest.approx(prof["ttft"], rel=1e-6)
    # ProphetKV's first pass is a part of its own (and only there).
    pass_one = [k for k in parts if k.startswith("ProphetKV pass 1")]
    summary = json.loads(out.read_text())["summary"]
    assert summary["selection"] == (selection or "prophet")
    assert bool(pass_one) == (summary["selection"] == "prophet")
    if pass_one:
        # the torch backend scores the query rows inside their attention: no separate part
        assert parts["ProphetKV pass 1: attention"] > 0
        assert parts.get("ProphetKV pass 1: scoring", 0.0) == 0.0
    assert 0 < prof["row_layers"] < prof["all_row_layers"]
    assert 0 < prof["key_row_layers_fraction"] < 1 and 0 < prof["attention_share"] < 1
    assert prof["key_floor_fraction"] == pytest.approx(prof["key_floor"] / prof["ttft"])
    assert summary["key_floor_fraction_blend"] == prof["key_floor_fraction"]
    printed = capsys.readouterr().out
    assert "of its floor" in printed and "key-weighted floor" in printed


def test_default_data_is_found_in_or_beside_the_checkout(tmp_path):
    from blendkv.eval.bench.blend import default_data

    repo = tmp_path / "checkout"
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert default_data(repo) == tmp_path / "shared" / "data" / "musique_dev.json"
    (repo / "shared" / "data").mkdir(parents=True)  # the checkout's own comes first
    assert default_data(repo) == repo / "shared" / "data" / "musique_dev.json"
