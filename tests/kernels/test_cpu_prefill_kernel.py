"""The C++ CPU prefill kernel (``torch.ops.blendkv_cpu.rows_attention``) against a dense
float64 oracle (explicit softmax over each row's keys), its input checks, and the engine with
it against the engine without it."""

from __future__ import annotations

import pytest
import torch
from helpers import QuietLLM, needs_cpp_compiler
from helpers import dense_attention_reference as dense_reference

from blendkv.kernels.cpu_prefill import RowsKernel, block_rows

pytestmark = needs_cpp_compiler


def _positions(layout: str, n_keys: int, gen) -> torch.Tensor:
    if layout == "scattered":  # CacheBlend's recomputed rows plus a query tail
        picked = torch.randperm(n_keys - 40, generator=gen)[:70].sort().values
        return torch.cat([picked, torch.arange(n_keys - 40, n_keys)])
    if layout == "causal":  # a fresh prefill
        return torch.arange(n_keys)
    if layout == "chunk":  # a chunked-prefill chunk over cached keys
        return torch.arange(n_keys - 77, n_keys)
    return torch.tensor([0, 1, n_keys - 1])  # "edges": the first keys and the last


@pytest.mark.parametrize("layout", ["scattered", "causal", "chunk", "edges"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads", [(3, 3, 64), (2, 7, 64), (1, 4, 128), (2, 5, 16)], ids=lambda h: "x".join(map(str, h))
)
def test_rows_attention_equals_the_oracle(heads, dtype, layout):
    """Constant-size (G, D) pairs and the generic loop; keys over several 256-key blocks (and a
    partial last one); rows not a multiple of the task's block (``block_rows``)."""
    hkv, g, d = heads
    gen = torch.Generator().manual_seed(hkv * 100 + g * 10 + d)
    n_keys = 601
    positions = _positions(layout, n_keys, gen)
    assert layout == "edges" or len(positions) % block_rows(g)  # a partial last block of rows
    q = torch.randn(len(positions), hkv * g, d, generator=gen).to(dtype)
    k = torch.randn(n_keys, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n_keys, hkv, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    RowsKernel()(q, k, v, positions, d**-0.5, out)
    ref = dense_reference(q, k, v, positions, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)


def _mass_oracle(q, k, positions, scale) -> torch.Tensor:
    """float64: the softmax probability each key gets, summed over rows and query heads."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)  # [S, Hq, D]
    scores = torch.einsum("nhd,shd->hns", q.double(), kk) * scale
    hidden = torch.arange(k.shape[0])[None, :] > positions[:, None]  # [n, S]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return probs.sum(dim=(0, 1))


@pytest.mark.parametrize("kept", [True, False], ids=["kept-probs", "recomputed-scores"])
@pytest.mark.parametrize("layout", ["scattered", "causal", "chunk", "edges"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads", [(3, 3, 64), (2, 7, 64), (2, 5, 16)], ids=lambda h: "x".join(map(str, h))
)
def test_rows_attention_adds_the_mass_the_rows_pay_each_key(heads, dtype, layout, kept):
    """``mass``: ProphetKV's score next to the same output, from the probabilities the
    attention pass kept or (past ``max_prob_floats``) from recomputed scores; added to what the
    tensor holds; zero past the last row's position."""
    hkv, g, d = heads
    gen = torch.Generator().manual_seed(hkv * 100 + g * 10 + d + 1)
    n_keys = 601
    positions = _positions(layout, n_keys - 30, gen)  # the last 30 keys: seen by no row
    q = torch.randn(len(positions), hkv * g, d, generator=gen).to(dtype)
    k = (2 * torch.randn(n_keys, hkv, d, generator=gen)).to(dtype)
    v = torch.randn(n_keys, hkv, d, generator=gen).to(dtype)
    out, alone = torch.empty_like(q), torch.empty_like(q)
    mass = torch.full((n_keys,), 0.5)
    RowsKernel(max_prob_floats=1 << 24 if kept else 0)(q, k, v, positions, d**-0.5, out, mass)
    RowsKernel()(q, k, v, positions, d**-0.5, alone)
    assert torch.equal(out, alone)
    want = _mass_oracle(q, k, positions, d**-0.5) + 0.5
    torch.testing.assert_close(mass.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(mass[-30:], torch.full((30,), 0.5))


def test_rows_attention_is_the_same_for_any_split_of_its_rows():
    """Rows are independent: blocks of 1, 5 or 32 rows per task (and the kernel's finer split
    for few rows), one thread or two, give the same bits. The mass is summed per task, then
    over tasks in order: the same bits for the same split, the same sums to rounding across
    splits."""
    from blendkv.kernels.cpu_extension import load_ops

    ops = load_ops()
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(35, 9, 64, generator=gen), torch.randn(500, 3, 64, generator=gen)
    v = torch.randn(500, 3, 64, generator=gen)
    positions = torch.arange(465, 500)
    results = []
    threads = torch.get_num_threads()
    try:
        for n_threads, block_rows in ((1, 32), (2, 32), (2, 5), (2, 1), (2, 5)):
            torch.set_num_threads(n_threads)
            out, mass = torch.empty_like(q), torch.zeros(500)
            ops.rows_attention(q, k, v, positions, 0.125, block_rows, out, mass, 0, 0.0)
            results.append((out, mass))
    finally:
        torch.set_num_threads(threads)
    for out, mass in results[1:]:
        assert torch.equal(out, results[0][0])
        torch.testing.assert_close(mass, results[0][1], atol=0, rtol=1e-5)
    assert torch.equal(results[2][1], results[4][1])


def test_query_rows_attention_matches_the_torch_product():
    """The cpu backend's ProphetKV rows: the C++ kernel's output and mass against the torch
    reference's ``attention_with_mass``."""
    from blendkv.kernels.cpu_attention import CpuAttentionBackend
    from blendkv.kernels.torch_attention import TorchAttentionBackend

    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(40, 9, 64, generator=gen),
        torch.randn(700, 3, 64, generator=gen),
        torch.randn(700, 3, 64, generator=gen),
    )
    positions = torch.arange(660, 700)
    outs, masses = [], []
    cpu = CpuAttentionBackend(prefill_kernel=True)
    assert cpu.rows_kernel is not None
    for backend in (cpu, TorchAttentionBackend()):
        out = torch.empty_like(q)
        masses.append(backend._query_rows(q, k, v, positions, 660, out))
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(masses[0], masses[1], atol=1e-5, rtol=1e-5)


def test_rows_attention_refuses_a_bad_mass():
    q, k = torch.randn(2, 2, 16), torch.randn(20, 1, 16)
    for bad in (torch.zeros(19), torch.zeros(20, dtype=torch.float64), torch.zeros(40)[::2]):
        with pytest.raises(RuntimeError, match="mass"):
            RowsKernel()(q, k, k, torch.tensor([0, 1]), 0.25, torch.empty_like(q), bad)


def test_rows_attention_writes_a_strided_out_and_reads_strided_inputs():
    """Views (a slice of a fused QKV output, a non-contiguous destination) are handled."""
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(50, 9 + 3 + 3, 64, generator=gen)
    q, k, v = fused[:, :9], fused[:, 9:12], fused[:, 12:]
    out = torch.zeros(50, 2, 9, 64)[:, 1]
    RowsKernel().causal(q, k, v, 0.125, out)
    ref = dense_reference(q, k, v, torch.arange(50), 0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("positions", "message"),
    [([3, 2], "ascend strictly"), ([1, 1], "ascend strictly"), ([0, 20], "within 0 .. S - 1")],
)
def test_rows_attention_refuses_bad_positions(positions, message):
    q, k = torch.randn(2, 2, 16), torch.randn(20, 1, 16)
    with pytest.raises(RuntimeError, match=message):
        RowsKernel()(q, k, k, torch.tensor(positions), 0.25, torch.empty_like(q))


def test_rows_attention_refuses_mixed_dtypes():
    q, k = torch.randn(2, 2, 16), torch.randn(20, 1, 16)
    with pytest.raises(RuntimeError, match="one dtype"):
        RowsKernel()(q, k.bfloat16(), k, torch.tensor([0, 1]), 0.25, torch.empty_like(q))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_the_kernel_equals_the_engine_without(tiny_llama_dir, dtype, monkeypatch):
    """A chunked prefill (fresh first chunk, then chunks over cached keys), a shared prefix and
    decode: the same greedy tokens as with SDPA, and logits as near the float32 SDPA engine's
    (float32: within 1e-4; bfloat16: no further than SDPA's own bfloat16 logits, up to a
    rounding step, as the kernel accumulates in float32)."""
    import blendkv.kernels.cpu_attention as cpu_attention
    from blendkv import SamplingParams

    monkeypatch.setattr(cpu_attention, "rows_kernel_wins", lambda: True)  # any CPU

    prompts = [list(range(5, 300)), list(range(5, 200)) + [7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    outs = {}
    for name, run_dtype, compiled in (
        ("kernel", dtype, True),
        ("sdpa", dtype, False),
        ("reference", "float32", False),
    ):
        llm = QuietLLM(
            str(tiny_llama_dir),
            dtype=run_dtype,
            attention_backend="cpu" if compiled else "torch",
            max_num_batched_tokens=128,
            block_size=16,
        )
        assert (getattr(llm.engine.attn_backend, "rows_kernel", None) is not None) is compiled
        got = llm.generate(prompts, params, logits_from=0)
        outs[name] = [(o.outputs[0].token_ids, o.extra["prompt_logits"].float()) for o in got]
        llm.close()
    for kernel, sdpa, ref in zip(outs["kernel"], outs["sdpa"], outs["reference"], strict=True):
        assert kernel[0] == sdpa[0]
        kernel_err = (kernel[1] - ref[1]).abs().max().item()
        sdpa_err = (sdpa[1] - ref[1]).abs().max().item()
        if dtype == "float32":
            assert kernel_err < 1e-4
        else:
            assert kernel_err <= sdpa_err + 0.0625


def test_bfloat16_output_is_the_oracle_rounded_once():
    """bf16 inputs: the kernel accumulates in float32 and rounds its output once (on a CPU with
    bf16 dot products it also rounds P to bf16 for P.V, as flash kernels do), so it lands at
    least as near the float64 oracle as SDPA's bf16 flash path, and near the output's own
    rounding."""
    from blendkv.kernels.torch_attention import dense_causal_attention

    gen = torch.Generator().manual_seed(0)
    n, d = 512, 64
    q = (torch.randn(n, 9, d, generator=gen) * 2).bfloat16()
    k = (torch.randn(n, 3, d, generator=gen) * 2).bfloat16()
    v = torch.randn(n, 3, d, generator=gen).bfloat16()
    ref = dense_reference(q, k, v, torch.arange(n), d**-0.5)
    out = torch.empty_like(q)
    RowsKernel().causal(q, k, v, d**-0.5, out)
    kernel_err = (out.double() - ref).abs().mean()
    sdpa_err = (dense_causal_attention(q, k, v, d**-0.5).double() - ref).abs().mean()
    rounding = (ref.bfloat16().double() - ref).abs().mean()
    assert kernel_err <= sdpa_err
    assert kernel_err <= rounding * 1.15
