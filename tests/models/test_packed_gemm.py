"""Packed GEMMs (blendkv.layers.linear): same results as ``F.linear``; MKL's used only for the
batch sizes they were packed for, oneDNN's for every batch; packed lazily, and switched on by
the engine only where they run (:mod:`blendkv.layers.cpu_platform`, ``EngineConfig.cpu_gemm``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.errors import ConfigError
from blendkv.layers.cpu_platform import (
    CpuTuning,
    apply_cpu_tuning,
    resolve_gemm,
    small_batch_gemms,
)
from blendkv.layers.fused import FusedLinear
from blendkv.layers.linear import (
    Linear,
    OneDNNWeight,
    PackedWeight,
    SmallBatchGemm,
    cpu_vendor,
    onednn_gemm_available,
    packed_gemm_available,
)

pytestmark = pytest.mark.skipif(
    not packed_gemm_available(torch.float32, "cpu"), reason="this torch build has no MKL"
)


@pytest.mark.parametrize("shape", [(96, 64), (200, 136)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [9, 13, 16])
def test_packed_weight_matches_linear(shape, bias, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(*shape, generator=g)
    b = torch.randn(shape[0], generator=g) if bias else None
    x = torch.randn(m, shape[1], generator=g)
    out = PackedWeight(w, b, 16)(x)
    assert out.shape == (m, shape[0])
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_small_batch_gemm_packs_lazily_and_only_for_its_batch_sizes():
    lin = Linear(64, 48, bias=True)
    x = torch.randn(40, 64)
    lin.gemm.enable(16)
    for m in (1, 8, 17, 40):  # at most half of 16, or more than 16: plain F.linear
        assert torch.equal(lin(x[:m]), F.linear(x[:m], lin.weight, lin.bias))
    assert lin.gemm.packed is None
    for m in (9, 16):
        torch.testing.assert_close(lin(x[:m]), F.linear(x[:m], lin.weight, lin.bias))
    assert lin.gemm.packed is not None and lin.gemm.packed.rows == 16
    lin.gemm.enable(0)
    assert lin.gemm.packed is None
    assert torch.equal(lin(x[:12]), F.linear(x[:12], lin.weight, lin.bias))


def test_fused_linear_packs_its_concatenated_weight():
    parts = [Linear(32, n) for n in (24, 8, 8)]
    fused = FusedLinear(parts)
    fused.gemm.enable(8)
    x = torch.randn(6, 32)
    outs = fused(x)
    assert fused.gemm.packed is not None
    for out, lin in zip(outs, parts, strict=True):
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias))


def _modules_packed(llm) -> int:
    return sum(g.packed is not None for g in small_batch_gemms(llm.engine.model))


def test_engine_decodes_through_packed_weights_with_the_same_tokens(tiny_qwen2_dir):
    prompts = [[3 + i, 40 + 2 * i, 7, 90 + i] for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    results = {}
    for rows in (0, 16):
        llm = QuietLLM(str(tiny_qwen2_dir), dtype="float32", cpu_gemm="mkl")
        tuning = llm.engine.cpu_tuning
        apply_cpu_tuning(llm.engine.model, CpuTuning("mkl", rows, tuning.mlp_rows_per_pass))
        results[rows] = llm.generate(prompts, params)
        # decode steps of 10 rows: fused q/k/v (biased), o, fused gate/up and down in each
        # layer, and lm_head; the unfused q/k/v/gate/up are never called, never packed
        layers = llm.engine.info.num_layers
        assert _modules_packed(llm) == (0 if rows == 0 else 4 * layers + 1)
        llm.close()
    for a, b in zip(results[0], results[16], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for tok in la:
                assert la[tok] == pytest.approx(lb[tok], abs=1e-4)


def test_engine_packs_by_default_on_the_cpu_in_float32_only(tiny_llama_dir):
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", cpu_gemm="mkl")
    assert llm.engine.cpu_tuning.packed_gemm_rows == 32
    llm.close()
    llm = QuietLLM(str(tiny_llama_dir), dtype="bfloat16", cpu_gemm="mkl")
    assert llm.engine.cpu_tuning.packed_gemm_rows == 0
    llm.close()
    with pytest.raises(ConfigError, match="cpu_gemm must be one of"):
        QuietLLM(str(tiny_llama_dir), cpu_gemm="blas")


def test_small_batch_gemm_is_off_until_enabled():
    gemm = SmallBatchGemm()
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(gemm(x, w, None), F.linear(x, w, None))
    assert gemm.packed is None


onednn = pytest.mark.skipif(
    not onednn_gemm_available(torch.float32, "cpu"), reason="this torch build has no oneDNN"
)
onednn_bf16 = pytest.mark.skipif(
    not onednn_gemm_available(torch.bfloat16, "cpu"), reason="no oneDNN bf16 kernels on this CPU"
)


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=onednn_bf16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 7, 32, 100])
def test_onednn_weight_matches_linear_for_any_batch(dtype, bias, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(136, 200, generator=g).to(dtype)
    b = torch.randn(136, generator=g).to(dtype) if bias else None
    x = torch.randn(m, 200, generator=g).to(dtype)
    out = OneDNNWeight(w, b)(x)
    assert out.shape == (m, 136) and out.dtype == dtype
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    # outputs of magnitude ~14: fp32 rounding, or bf16's 8 bits of mantissa on the output
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (0.1, 0.01)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


@onednn
def test_onednn_gemm_packs_lazily_and_serves_every_batch():
    lin = Linear(64, 48, bias=True)
    lin.gemm.enable_onednn()
    assert lin.gemm.packed is None
    x = torch.randn(70, 64)
    for m in (1, 9, 70):
        torch.testing.assert_close(lin(x[:m]), F.linear(x[:m], lin.weight, lin.bias))
    assert isinstance(lin.gemm.packed, OneDNNWeight)
    lin.gemm.enable(0)  # back to F.linear, the packed copy dropped
    assert lin.gemm.packed is None and torch.equal(
        lin(x[:5]), F.linear(x[:5], lin.weight, lin.bias)
    )


@onednn
def test_engine_with_onednn_gemms_decodes_the_same_tokens(tiny_qwen2_dir):
    """Every linear map (the biased fused q/k/v too) through oneDNN, prefill and decode: the
    same greedy tokens as MKL's, logprobs within fp32 rounding."""
    prompts = [[3 + i, 40 + 2 * i, 7, 90 + i] for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    results = {}
    for gemm in ("mkl", "onednn"):
        llm = QuietLLM(str(tiny_qwen2_dir), dtype="float32", cpu_gemm=gemm)
        assert llm.engine.cpu_tuning.gemm == gemm
        results[gemm] = llm.generate(prompts, params)
        if gemm == "onednn":
            assert llm.engine.cpu_tuning.packed_gemm_rows == 0
            assert _modules_packed(llm) == 4 * llm.engine.info.num_layers + 1
        llm.close()
    for a, b in zip(results["mkl"], results["onednn"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for tok in la:
                assert la[tok] == pytest.approx(lb[tok], abs=1e-4)


@onednn
def test_cpu_gemm_choice_and_errors(tiny_llama_dir):
    """Unset: oneDNN except on Intel CPUs (where MKL's packed GEMMs were measured); bfloat16
    packs too; float16 does not run there."""
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32")
    want = "mkl" if cpu_vendor() == "GenuineIntel" else "onednn"
    assert llm.engine.cpu_tuning.gemm == want
    llm.close()
    if onednn_gemm_available(torch.bfloat16, "cpu"):
        llm = QuietLLM(str(tiny_llama_dir), dtype="bfloat16", cpu_gemm="onednn")
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        assert _modules_packed(llm) > 0
        llm.close()
    with pytest.raises(ConfigError, match="cpu_gemm='onednn' needs float32, or bfloat16"):
        QuietLLM(str(tiny_llama_dir), dtype="float16", cpu_gemm="onednn")


@pytest.mark.parametrize(
    ("vendor", "dtype", "device", "want"),
    [
        ("GenuineIntel", torch.float32, "cpu", "mkl"),
        ("AuthenticAMD", torch.float32, "cpu", "onednn"),
        ("AuthenticAMD", torch.bfloat16, "cpu", "onednn"),
        ("unknown", torch.float32, "cpu", "onednn"),
        ("GenuineIntel", torch.bfloat16, "cpu", "torch"),  # neither packs: F.linear
        ("AuthenticAMD", torch.float16, "cpu", "torch"),
        ("AuthenticAMD", torch.float32, "cuda", "torch"),
    ],
)
def test_cpu_gemm_is_picked_by_vendor_dtype_and_device(monkeypatch, vendor, dtype, device, want):
    import blendkv.layers.cpu_platform as cpu_platform

    if want == "onednn" and not onednn_gemm_available(dtype, "cpu"):
        pytest.skip("no oneDNN (or none of its bf16 kernels) here")
    monkeypatch.setattr(cpu_platform, "cpu_vendor", lambda: vendor)
    assert resolve_gemm("auto", dtype, device) == want
    assert resolve_gemm("mkl", dtype, device) == "mkl"
