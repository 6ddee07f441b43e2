"""``blendkv eval --reference-cache``: full prefill's answers are read back, not recomputed."""

from __future__ import annotations

import json

import pytest
import torch

from blendkv.cli import main
from blendkv.eval.methods import MethodRun
from blendkv.eval.reference_cache import ReferenceCache

ARGS = ["eval", "--data", "synthetic", "--limit", "2", "--methods", "full,reuse,blend@0.5"]
ARGS += ["--dtype", "float32", "--max-tokens", "4", "--no-progress"]


def _records(out):
    return [json.loads(line) for line in (out / "per_example.jsonl").open()]


def test_a_second_run_reads_full_prefill_from_the_cache(eval_model_dir, tmp_path, capsys):
    cache = tmp_path / "ref"
    first, second = tmp_path / "a", tmp_path / "b"
    args = [*ARGS, "--model", str(eval_model_dir), "--reference-cache", str(cache)]
    assert main([*args, "--out", str(first)]) == 0
    assert len(list(cache.glob("*.pt"))) == 2
    assert "came from --reference-cache" not in capsys.readouterr().out
    assert main([*args, "--out", str(second)]) == 0
    assert "full prefill of 2 example(s) came from --reference-cache" in capsys.readouterr().out
    a, b = _records(first), _records(second)
    assert [r["reference_cached"] for r in a] == [False] * 6
    assert [r["reference_cached"] for r in b] == [True] * 6
    full_a = [r for r in a if r["method"] == "full"]
    full_b = [r for r in b if r["method"] == "full"]
    for x, y in zip(full_a, full_b, strict=True):  # the stored run, TTFT included
        assert (x["generation"], x["ttft_s"]) == (y["generation"], y["ttft_s"])
    for x, y in zip(a, b, strict=True):  # the same reference: the same fidelity
        assert x["method"] == y["method"]
        assert y["answer_kl"] == pytest.approx(x["answer_kl"], abs=1e-6)
    assert "came from --reference-cache" in (second / "report.md").read_text()
    assert "came from --reference-cache" not in (first / "report.md").read_text()
    results = json.loads((second / "results.json").read_text())
    assert results["config"]["reference_cache_hits"] == 2


def _entry():
    return MethodRun([5, 6], "ab", 1.5, 0, None), torch.randn(3, 11)


def test_the_key_covers_the_prompt_and_the_settings(tmp_path):
    cache = ReferenceCache(tmp_path, {"model": "m", "max_tokens": 4})
    run, rows = _entry()
    cache.put([1, 2, 3], run, rows)
    got = cache.get([1, 2, 3])
    assert got is not None and got[0] == run and torch.equal(got[1], rows)
    assert cache.get([1, 2, 4]) is None  # another prompt
    assert ReferenceCache(tmp_path, {"model": "m", "max_tokens": 5}).get([1, 2, 3]) is None
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_damaged_entry_is_a_miss_and_is_written_again(tmp_path, caplog):
    cache = ReferenceCache(tmp_path, {"model": "m"})
    run, rows = _entry()
    cache.put([1], run, rows)
    (path,) = tmp_path.glob("*.pt")
    path.write_bytes(path.read_bytes()[:40])  # torn
    assert cache.get([1]) is None
    assert "unreadable" in caplog.text
    other = ReferenceCache(tmp_path, {"model": "m"})
    other.put([2], run, rows)  # another prompt's entry under this prompt's name
    (path2,) = [p for p in tmp_path.glob("*.pt") if p != path]
    path.write_bytes(path2.read_bytes())
    assert cache.get([1]) is None
    cache.put([1], run, rows)
    assert cache.get([1]) is not None
    assert not list(tmp_path.glob("*.tmp"))
