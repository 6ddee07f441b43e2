"""The C++ CPU decode kernel (``torch.ops.blendkv_cpu.decode_attention``) against a dense
float64 oracle, its input checks, and its build (cache, failure)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import QuietLLM, needs_cpp_compiler

from blendkv.kernels import cpu_extension
from blendkv.kernels.cpu_decode import DecodeKernel, DenseDecode, dense_decode_attention

pytestmark = needs_cpp_compiler


def _case(hkv: int, g: int, d: int, dtype, seed: int):
    """A pool of shuffled 4-slot blocks, 9 step rows of which 6 decode (out of order, two
    sharing blocks); padding slots past each row's length point at other rows' keys."""
    gen = torch.Generator().manual_seed(seed)
    bs, num_blocks = 4, 64
    pool = torch.randn(2, num_blocks * bs, hkv, d, generator=gen).to(dtype)
    lens = [1, 37, 90, 12, 5, 64]
    perm = torch.randperm(num_blocks, generator=gen)
    slots = torch.randint(0, num_blocks * bs, (len(lens), max(lens)), generator=gen)
    used = 0
    for r, n in enumerate(lens):
        blocks = perm[used : used + -(-n // bs)]
        used += 0 if r == 0 else len(blocks)  # rows 0 and 1 share their first block
        slots[r, :n] = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
    q = torch.randn(9, hkv * g, d, generator=gen).to(dtype)
    rows = torch.tensor([7, 0, 3, 8, 1, 5])
    return q, pool, DenseDecode(rows, slots, torch.tensor(lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads", [(3, 3, 64), (2, 7, 64), (1, 4, 128), (2, 5, 16)], ids=lambda h: "x".join(map(str, h))
)
def test_kernel_equals_the_dense_oracle(heads, dtype):
    """Specialised (G, D) pairs (SmolLM2's 3x64, Qwen 0.5B's 7x64, 4x128) and the generic loop
    (5x16); only the decode rows are written."""
    hkv, g, d = heads
    q, pool, layout = _case(hkv, g, d, dtype, seed=hkv * 100 + g * 10 + d)
    ops = cpu_extension.load_ops()
    out = torch.full_like(q, 7.0)
    ops.decode_attention(q, pool[0], pool[1], layout.rows, layout.slots, layout.lens, d**-0.5, out)
    ref = dense_decode_attention(
        q[layout.rows].double().view(-1, hkv, g, d),
        pool[0].double(),
        pool[1].double(),
        layout.slots,
        layout.lens,
        d**-0.5,
    ).reshape(-1, hkv * g, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out[layout.rows].double(), ref, atol=tol, rtol=0)
    others = [i for i in range(len(q)) if i not in layout.rows.tolist()]
    assert torch.all(out[others] == 7.0)


def test_kernel_with_many_rows_of_mixed_lengths():
    """Rows enough for whole-row tasks (>= 4 per thread), long ones first then short ones,
    handed out longest first; every row equals the oracle."""
    gen = torch.Generator().manual_seed(4)
    hkv, g, d = 3, 3, 64
    lens = [300] * 4 + [3 + i for i in range(4 * torch.get_num_threads() + 4)]
    slots = torch.stack(
        [torch.randperm(1200, generator=gen)[: max(lens)] for _ in lens]
    )  # any slots, shared between rows
    pool = torch.randn(2, 1200, hkv, d, generator=gen)
    q = torch.randn(len(lens), hkv * g, d, generator=gen)
    layout = DenseDecode(torch.arange(len(lens)), slots, torch.tensor(lens))
    out = torch.empty_like(q)
    cpu_extension.load_ops().decode_attention(
        q, pool[0], pool[1], layout.rows, layout.slots, layout.lens, 0.125, out
    )
    ref = dense_decode_attention(
        q.double().view(-1, hkv, g, d),
        pool[0].double(),
        pool[1].double(),
        slots,
        layout.lens,
        0.125,
    )
    torch.testing.assert_close(out.double(), ref.reshape(len(lens), -1, d), atol=1e-5, rtol=0)


def test_decode_kernel_reads_the_layer_pool_and_a_strided_q():
    """Through the backend's wrapper: a [2, blocks, block_size, Hkv, D] layer cache and a q
    sliced out of a wider tensor (not contiguous)."""
    hkv, g, d = 3, 3, 64
    q, pool, layout = _case(hkv, g, d, torch.float32, seed=1)
    cache = pool.view(2, -1, 4, hkv, d)
    wide = torch.cat([q, torch.randn_like(q)], dim=1)
    strided_q = wide[:, : hkv * g]
    assert not strided_q.is_contiguous()
    out = torch.zeros_like(q)
    DecodeKernel()(strided_q, cache, layout, out, 0.125)
    ref = dense_decode_attention(
        q[layout.rows].view(-1, hkv, g, d), pool[0], pool[1], layout.slots, layout.lens, 0.125
    )
    torch.testing.assert_close(out[layout.rows], ref.reshape(-1, hkv * g, d), atol=1e-5, rtol=0)


def test_kernel_rejects_bad_inputs():
    ops = cpu_extension.load_ops()
    q, pool, layout = _case(2, 3, 16, torch.float32, seed=2)
    out = torch.zeros_like(q)

    def call(q=q, rows=layout.rows, lens=layout.lens):
        ops.decode_attention(q, pool[0], pool[1], rows, layout.slots, lens, 0.25, out)

    no_keys = layout.lens.clone()
    no_keys[2] = 0
    with pytest.raises(RuntimeError, match="1 .. L keys"):
        call(lens=no_keys)
    with pytest.raises(RuntimeError, match="one dtype"):
        call(q=q.double())
    with pytest.raises(RuntimeError, match="int64"):
        call(rows=layout.rows.int())


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(cpu_extension.CPUKernelBuildError, match="compiling decode_attention"):
        cpu_extension.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_cache_is_a_build_error(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(cpu_extension.CPUKernelBuildError, match="BLENDKV_CACHE"):
        cpu_extension.build(tmp_path / "a_file" / "extensions")


def test_the_build_is_cached_and_a_broken_cache_is_built_again(tmp_path):
    """A build finds a matching library in its cache and compiles nothing; a cached library
    that does not load is rebuilt, in a fresh process (torch registers the op namespace once
    per process). The library the suite already built is copied in as the first build, and the
    rebuild's compiler is a stand-in that logs its arguments and copies that library to its
    ``-o`` (a real compile takes minutes on 2 cores; the suite's first build is one)."""
    import shutil
    import subprocess
    import sys

    built = cpu_extension.build()  # the default cache: built once per machine and torch
    path = tmp_path / "extensions" / built.name
    path.parent.mkdir()
    shutil.copy2(built, path)
    mtime = path.stat().st_mtime_ns
    assert cpu_extension.build(tmp_path / "extensions") == path
    assert path.stat().st_mtime_ns == mtime and path.name.startswith("blendkv_cpu_")
    assert list(path.parent.iterdir()) == [path]
    path.write_bytes(b"not an ELF file")
    log = tmp_path / "compiler.log"
    compiler = tmp_path / "c++"
    compiler.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = --version ] && exec {cpu_extension.find_compiler()} --version\n'
        f'echo "$@" >> {log}\n'
        "for out; do :; done\n"  # the last argument: the file after -o
        f'cp {built} "$out"\n'
    )
    compiler.chmod(0o755)
    script = (
        "from blendkv.kernels.cpu_extension import load_ops; "
        "print(hasattr(load_ops(), 'decode_attention'))"
    )
    env = {**os.environ, "BLENDKV_CACHE": str(tmp_path), "CXX": str(compiler)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True" and "building them again" in done.stderr
    assert path.read_bytes()[:4] == b"\x7fELF"
    (call,) = log.read_text().splitlines()  # compiled once, every source, into a temporary file
    assert all(str(src) in call for src in cpu_extension.SOURCES)
    assert call.split()[-2] == "-o" and call.split()[-1].endswith(".so")


def test_the_cpu_backend_runs_the_reference_when_the_kernels_cannot_be_built(monkeypatch, caplog):
    """A warning says why; every op then runs the torch reference."""
    from blendkv.kernels.backends import get_blend_kernels
    from blendkv.kernels.cpu_attention import CpuAttentionBackend

    def fail():
        raise cpu_extension.CPUKernelBuildError("no C++ compiler found")

    monkeypatch.setattr(cpu_extension, "load_ops", fail)
    with caplog.at_level(logging.INFO, logger="blendkv.kernels.cpu_attention"):
        backend = CpuAttentionBackend(prefill_kernel=True)
    assert backend.ops is None and backend.decode_kernel is None and backend.rows_kernel is None
    assert not get_blend_kernels(backend).fused_chunk_shift
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "attention runs torch: no C++ compiler found" in record.getMessage()


def test_the_engine_takes_the_cpu_backend_by_default_on_the_cpu(tiny_llama_dir):

    for dtype in ("float32", "bfloat16"):
        llm = QuietLLM(str(tiny_llama_dir), dtype=dtype)
        assert llm.engine.attn_backend.name == "cpu"
        assert llm.engine.attn_backend.decode_kernel is not None
        llm.close()
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", attention_backend="torch")
    assert llm.engine.attn_backend.name == "torch"
    assert not hasattr(llm.engine.attn_backend, "decode_kernel")
    llm.close()


def test_the_cpu_backend_runs_the_reference_for_other_dtypes(caplog):
    """float16: the decode layout is the reference's, logged once."""
    from blendkv.kernels.cpu_attention import CpuAttentionBackend
    from blendkv.kernels.cpu_decode import DenseDecode as Dense

    backend = CpuAttentionBackend()
    cache = torch.zeros(2, 8, 4, 1, 16)
    md = backend.build_metadata([5, 2], [1, 1], [[0, 1], [2]], 4)
    with caplog.at_level(logging.INFO, logger="blendkv.kernels.cpu_attention"):
        for dtype in (torch.float16, torch.float16, torch.float32):
            layout = backend._decode_layout(
                md, [0, 1], cache.shape, torch.zeros(2, 2, 16, dtype=dtype)
            )
            assert isinstance(layout, Dense) == (dtype == torch.float32)
    assert len(caplog.records) == 1 and "not torch.float16" in caplog.records[0].getMessage()
