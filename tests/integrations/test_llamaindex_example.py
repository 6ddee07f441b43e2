"""``examples/llamaindex_query_engine.py`` runs its main path end to end (on the tiny random
Llama: the embedded model's answers are checked by running the example itself)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core", reason="llama-index-core is not installed")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llamaindex_query_engine.py"


def test_example_prints_answers_with_their_sources(tiny_llama_dir, capsys):
    spec = importlib.util.spec_from_file_location("llamaindex_query_engine", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--model", str(tiny_llama_dir)])
    out = capsys.readouterr().out
    assert "3 document(s) added" in out
    assert out.count("\nQ: ") == 2 and out.count("\nA: ") == 2
    assert "3/3 chunks from the store" in out
    # Each answer lists its 3 source chunks by file name.
    for name in ("python_language.md", "solar_system.md"):
        assert name in out
    assert (
        sum(line.startswith("  0.") or line.startswith("  -0.") for line in out.splitlines()) == 6
    )
