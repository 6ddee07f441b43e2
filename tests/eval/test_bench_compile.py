"""``blendkv bench compile``: the Triton kernels compiled for an H100 on a machine without a GPU
(:mod:`blendkv.eval.bench.compile`). Each run is a fresh process without
``TRITON_INTERPRET`` (the suite interprets), with its own Triton cache, so every kernel is
compiled here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed")

from blendkv.cli import main  # noqa: E402
from blendkv.eval.bench.compile import Variant, problems  # noqa: E402

CLI = "import sys; from blendkv.cli import main; sys.exit(main(sys.argv[1:]))"

# Every kernel the engine launches on the Triton backend for a Llama model (the batched,
# chunked and split-key prefill, decode, ProphetKV's pass, CacheBlend's pick, the K/V
# correction with the pooled prior, raw and int8 store loads).
ENGINE_KERNELS = {
    "_dequant_rope_load_kernel",
    "_decode_stage1_kernel",
    "_decode_stage2_kernel",
    "_lse_kernel",
    "_mass_kernel",
    "_prefill_combine_kernel",
    "_prefill_kernel",
    "_rms_norm_kernel",
    "_rope_load_kernel",
    "_rotary_qk_kernel",
    "_shift_kernel",
    "_silu_and_mul_kernel",
    "_sums_kernel",
}


def compile_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}


def test_every_engine_kernel_compiles_for_an_h100(tmp_path):
    """At the 8B shape (a real model's head size and tuned tiles): every variant is a ptxas run
    of seconds, so the tiny shape's variants are left to ``blendkv bench compile``."""
    out = tmp_path / "variants.json"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CLI,
            "bench",
            "compile",
            "--arch",
            "90",
            "--shapes",
            "llama8b",
            "--json",
            str(out),
        ],
        env=compile_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == []
    variants = report["variants"]
    assert {v["kernel"] for v in variants if v["shape"] == "llama8b"} == ENGINE_KERNELS
    # The 8B shape's prefill kernel runs the H100/H200 table's tiles (8 warps, 2 stages), not
    # the defaults (4, 3); they ask for more shared memory than the defaults and still fit.
    prefill = [v for v in variants if v["kernel"] == "_prefill_kernel" and v["shape"] == "llama8b"]
    assert prefill and all((v["num_warps"], v["num_stages"]) == (8, 2) for v in prefill)
    assert all(100_000 < v["shared"] <= 232_448 for v in prefill)
    assert all(v["registers"] and v["registers"] <= 255 for v in variants)
    assert "variants of 13 kernels compiled for sm_90" in done.stdout


BAD_KERNEL = textwrap.dedent(
    """
    import torch
    import triton
    import triton.language as tl
    from blendkv.eval.bench.compile import compile_only

    @triton.jit
    def add_rows(x_ptr, out_ptr, rows, N: tl.constexpr):
        i = tl.arange(0, N)
        acc = tl.zeros([N], dtype=tl.float32)
        for r in tl.static_range(rows):  # not a constexpr: only the interpreter runs it
            acc += tl.load(x_ptr + r * N + i)
        tl.store(out_ptr + i, acc)

    x, out = torch.ones(3, 16), torch.zeros(16)
    if {interpret}:
        add_rows[(1,)](x, out, 3, N=16)
        print("ran", out[0].item())
    else:
        with compile_only(90, [], "test"):
            add_rows[(1,)](x, out, 3, N=16)
    """
)


def test_a_kernel_the_interpreter_runs_but_the_compiler_rejects_is_caught(tmp_path):
    """What the offline compile adds to the interpreter tests."""
    script = tmp_path / "bad.py"
    script.write_text(BAD_KERNEL.format(interpret=True))
    interpreted = subprocess.run(
        [sys.executable, str(script)],
        env={**compile_env(tmp_path), "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert interpreted.returncode == 0 and "ran 3.0" in interpreted.stdout, interpreted.stderr
    script.write_text(BAD_KERNEL.format(interpret=False))
    compiled = subprocess.run(
        [sys.executable, str(script)],
        env=compile_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert compiled.returncode != 0 and "CompilationError" in compiled.stderr
    assert "static_range" in compiled.stderr


def test_shared_memory_over_the_targets_limit_is_a_problem():
    fits = Variant("_prefill_kernel", "llama8b", "a", 8, 2, 163_840)
    too_big = Variant("_prefill_kernel", "llama8b", "b", 8, 3, 245_760)
    assert problems([fits, too_big], 90) == [
        "_prefill_kernel (llama8b): 245760 bytes of shared memory > 232448"
    ]
    assert problems([fits], 86) and not problems([fits], 80)  # an RTX 30x0's 99 KB


def test_refuses_to_interpret(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["bench", "compile", "--shapes", "tiny"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err
