"""CLI exit codes and output, in-process (``blendkv.cli.main``) plus one subprocess run.

Model-loading cases use the tiny random checkpoint: only the plumbing is under test here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import QUIET_FLAGS, QuietLLM
from rag_helpers import DEMO_DOCS

from blendkv.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_store(tiny_llama_dir, tmp_path_factory):
    """A store built by the tiny model (float32) over the demo docs, through the CLI."""
    store = tmp_path_factory.mktemp("cli") / "store"
    args = ["--store", str(store), "--model", str(tiny_llama_dir), "--dtype", "float32"]
    args += QUIET_FLAGS
    assert main(["ingest", str(DEMO_DOCS), "--chunk-tokens", "64", "--no-progress", *args]) == 0
    return store, args


def test_ingest_ask_stats_verify(tiny_store, capsys):
    store, args = tiny_store
    capsys.readouterr()
    assert main(["ingest", str(DEMO_DOCS), "--no-progress", *args]) == 0
    assert "0 document(s) added" in capsys.readouterr().out  # idempotent
    assert (
        main(["ask", "Who created Python?", "--top-k", "2", "--max-tokens", "2", "--json", *args])
        == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert len(record["sources"]) == 2
    assert record["blend_stats"]["chunks_hit"] == 2
    assert record["blend_stats"]["chunks_missed"] == 0
    assert main(["store", "stats", "--store", str(store), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["documents"] == 3 and stats["chunks"] == stats["indexed_chunks"] > 0
    assert main(["store", "verify", "--store", str(store)]) == 0
    assert "OK" in capsys.readouterr().out


def test_bad_files_exit_2_and_keep_the_store(tiny_store, tmp_path, capsys):
    store, args = tiny_store
    binary = tmp_path / "a.txt"
    binary.write_bytes(b"\x00\x01\x02binary")
    empty = tmp_path / "empty.md"
    empty.write_text("")
    for bad in (binary, empty, tmp_path / "missing.md", tmp_path):
        assert main(["ingest", str(bad), "--no-progress", *args]) == 2
        assert "blendkv: error:" in capsys.readouterr().err
    assert main(["store", "verify", "--store", str(store)]) == 0


def test_wrong_model_exits_2(tiny_store, capsys):
    store, args = tiny_store
    other = [a if a != "float32" else "bfloat16" for a in args]  # same model, other dtype
    assert main(["ask", "Who created Python?", *other]) == 2
    assert "built with dtype float32; this model is bfloat16" in capsys.readouterr().err


def test_empty_store_exits_2(tiny_llama_dir, tmp_path, capsys):
    from blendkv.rag import RAGPipeline

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32")
    RAGPipeline(tmp_path / "empty", llm=llm).close()
    llm.close()
    args = [
        "--store",
        str(tmp_path / "empty"),
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
    ]
    assert main(["ask", "anything?", *args]) == 2
    assert "holds no chunks" in capsys.readouterr().err


def test_missing_store_exits_2_without_a_model(tmp_path, capsys):
    for argv in (
        ["ask", "q", "--store", str(tmp_path / "nope")],
        ["store", "stats", "--store", str(tmp_path / "nope")],
        ["store", "verify", "--store", str(tmp_path / "nope")],
    ):
        assert main(argv) == 2
        assert "no blendkv store" in capsys.readouterr().err
    proc = subprocess.run(
        [sys.executable, "-m", "blendkv.cli", "ask", "q", "--store", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no blendkv store" in proc.stderr


def test_engine_options_reach_the_engine_config():
    """--num-threads, --no-prune-last-layer and the prefetch options go into every model
    command's engine kwargs; serve's --no-prefix-caching (an alias) turns the prefix cache off."""
    from blendkv.cli import build_parser, engine_kwargs
    from blendkv.connector.config import BlendConnectorConfig
    from blendkv.engine_args import create_engine_config

    for command in (["generate", "hi"], ["ask", "q", "--store", "s"], ["serve"]):
        options = ["--num-threads", "3", "--no-prune-last-layer"]
        options += ["--no-prefetch-kv", "--prefetch-kv-bytes", "4096"]
        kwargs = engine_kwargs(build_parser().parse_args([*command, *options]))
        assert kwargs["num_threads"] == 3
        assert kwargs["prune_last_layer"] is False and kwargs["prefetch_kv"] is False
        assert kwargs["prefetch_kv_bytes"] == 4096
        kwargs.pop("warmup")  # LLM's own, not the engine config's
        create_engine_config(**kwargs)  # valid config fields
        defaults = engine_kwargs(build_parser().parse_args(command))
        assert defaults["num_threads"] is None
        assert defaults["prune_last_layer"] is True
        assert defaults["prefetch_kv"] is None
        assert defaults["prefetch_kv_bytes"] == BlendConnectorConfig().prefetch_kv_bytes
    serve = engine_kwargs(build_parser().parse_args(["serve", "--no-prefix-caching"]))
    assert serve["enable_prefix_caching"] is False
    assert engine_kwargs(build_parser().parse_args(["serve"]))["enable_prefix_caching"] is True
