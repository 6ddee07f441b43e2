"""``blendkv eval --kv-codec``: reuse/blend methods once per stored-K/V codec, from a store of
that codec, next to ``none``'s rows (tiny model, one example)."""

from __future__ import annotations

import json

import pytest

from blendkv.cli import main
from blendkv.errors import ConfigError
from blendkv.eval.codecs import parse_codecs


def test_parse_codecs_puts_none_first_and_refuses_unknown_names():
    assert parse_codecs("int4,int8") == ["none", "int4", "int8"]
    assert parse_codecs("none") == ["none"]
    with pytest.raises(ConfigError, match="int8"):
        parse_codecs("int3")


DATA = [
    {
        "question": "Which city is the capital of France?",
        "answers": ["Paris"],
        "ctxs": [
            {"title": "", "text": "Paris is the capital of France. The Seine flows through it."},
            {"title": "", "text": "Berlin is the capital of Germany. It has many museums."},
        ],
    }
]


def test_eval_runs_reuse_on_every_codec(tiny_llama_dir, tmp_path):
    data = tmp_path / "data.json"
    data.write_text(json.dumps(DATA))
    argv = ["eval", "--data", str(data), "--methods", "full,reuse"]
    argv += ["--model", str(tiny_llama_dir), "--dtype", "float32", "--max-tokens", "4"]
    argv += ["--kv-codec", "int8,int4", "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 0
    tmp_path = tmp_path / "out"
    doc = json.loads((tmp_path / "results.json").read_text())
    assert list(doc["methods"]) == ["full", "reuse", "reuse[int8]", "reuse[int4]"]
    per_token = doc["config"]["store_bytes_per_token"]
    assert per_token["none"] > 1.9 * per_token["int8"] > 0  # float32 K/V here
    assert per_token["int8"] > per_token["int4"] > 0
    records = [json.loads(line) for line in (tmp_path / "per_example.jsonl").open()]
    kl = {r["method"]: r["answer_kl"] for r in records}
    assert kl["reuse[int8]"] != kl["reuse"] or kl["reuse[int4]"] != kl["reuse"]
    stats = {r["method"]: r["blend_stats"] for r in records}
    assert all(
        stats[m]["chunks_hit"] > 0 and stats[m]["chunks_missed"] == 0
        for m in ("reuse", "reuse[int8]", "reuse[int4]")
    )
