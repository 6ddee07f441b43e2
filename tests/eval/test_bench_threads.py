"""``blendkv bench threads``: every wait setting runs in its own process, alone and beside a busy
one; the greedy tokens must be the same under every setting before any figure is reported, and
every figure is reported against libgomp's default.

One child runs for real on the tiny model (its environment, its JSON line); the command's round
of six children runs with each child's answer recorded from it, so the test starts one process
that imports torch, not six."""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import pytest

from blendkv.cli import main
from blendkv.eval.bench import threads
from blendkv.openmp_env import SPIN_COUNT

ARGS = ["--prefill-tokens", "48", "--num-requests", "2", "--output-tokens", "3"]


def _args(model: str) -> argparse.Namespace:
    return argparse.Namespace(
        model=model, dtype="float32", prefill_tokens=48, num_requests=2, output_tokens=3
    )


@pytest.fixture(scope="module")
def child(tiny_llama_dir) -> dict:
    """One real child's answer: libgomp's own default spin, the tiny model, float32."""
    return threads._run_setting(_args(str(tiny_llama_dir)), "libgomp")


def test_a_child_times_prefill_and_decode_in_its_own_process(child):
    assert set(child) == {"timings", "tokens"}
    assert set(child["timings"]) == {"prefill_s", "decode1_tok_s", "decode2_tok_s"}
    assert all(v > 0 for v in child["timings"].values())
    one, two = child["tokens"]
    assert len(one) == 1 and len(two) == 2 and all(len(t) == 3 for t in one + two)


def test_the_child_runs_under_its_settings_environment(monkeypatch):
    """Each setting's variables reach its child, and no other setting's, nor the spin count
    ``import blendkv`` set in this process."""
    seen = {}

    def run(cmd, env, **kwargs):
        seen[env.get("GOMP_SPINCOUNT"), env.get("OMP_WAIT_POLICY")] = cmd
        line = json.dumps({"timings": {}, "tokens": []})
        return subprocess.CompletedProcess(cmd, 0, stdout=line + "\n", stderr="")

    monkeypatch.setattr(threads.subprocess, "run", run)
    assert os.environ["GOMP_SPINCOUNT"] == SPIN_COUNT
    args = _args("m")
    for setting in threads.SETTINGS:
        threads._run_setting(args, setting)
    assert set(seen) == {(None, None), ("300000", None), (None, "PASSIVE")}
    cmd = seen[None, None]
    assert cmd[1:4] == ["-m", "blendkv.eval.bench.threads", "--child"]
    assert cmd[cmd.index("--model") + 1] == "m"


def _recorded(child, tokens=None):
    """A stand-in for the children: the real child's tokens and figures (1 s, 1 token/s) scaled
    per setting and load; it records which settings ran beside a live busy process."""
    calls = []

    def run(args, setting):
        busy = [p for p in started if p.poll() is None]
        calls.append((setting, bool(busy)))
        scale = {"blendkv": 1.0, "libgomp": 2.0, "passive": 4.0}[setting] * (1 + len(busy))
        timings = {k: scale for k in child["timings"]}
        return {"timings": timings, "tokens": (tokens or {}).get(setting, child["tokens"])}

    started = []
    spawn = threads._busy

    def busy():
        started.append(spawn())
        return started[-1]

    return run, busy, calls, started


def test_every_setting_alone_and_beside_a_busy_process(child, tmp_path, capsys, monkeypatch):
    run, busy, calls, started = _recorded(child)
    monkeypatch.setattr(threads, "_run_setting", run)
    monkeypatch.setattr(threads, "_busy", busy)
    out = tmp_path / "threads.json"
    args = ["bench", "threads", "--model", "m", "--dtype", "float32", *ARGS]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens_equal"]
    assert calls == [(s, load) for load in (False, True) for s in ("blendkv", "libgomp", "passive")]
    (proc,) = started  # one busy process, for the second round, and it is gone
    assert proc.poll() is not None
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
        assert rows[(load, "blendkv")]["prefill_vs_libgomp"] == 0.5  # against the same load
        assert rows[(load, "passive")]["decode2_vs_libgomp"] == 2.0
    assert "beside a busy process" in capsys.readouterr().out


def test_tokens_that_differ_between_settings_are_refused(child, monkeypatch):
    one, two = child["tokens"]
    other = [[[t + 1 for t in one[0]]], two]
    run, busy, _, _ = _recorded(child, tokens={"passive": other})
    monkeypatch.setattr(threads, "_run_setting", run)
    monkeypatch.setattr(threads, "_busy", busy)
    with pytest.raises(RuntimeError, match="greedy tokens differ"):
        main(["bench", "threads", "--model", "m", "--dtype", "float32", *ARGS])
