"""Packed small-batch GEMMs (blendkv.layers.linear): same results as ``F.linear``, used only
for the batch sizes they were packed for, packed lazily, and switched on by the engine only
where MKL's packed sgemm runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blendkv import LLM, SamplingParams
from blendkv.errors import ConfigError
from blendkv.layers.fused import FusedLinear
from blendkv.layers.linear import (
    Linear,
    PackedWeight,
    SmallBatchGemm,
    packed_gemm_available,
    small_batch_gemms,
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
        llm = LLM(str(tiny_qwen2_dir), dtype="float32", packed_gemm_rows=rows)
        assert llm.engine.packed_gemm_rows == rows
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
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    assert llm.engine.packed_gemm_rows == 32
    llm.close()
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16")
    assert llm.engine.packed_gemm_rows == 0
    llm.close()
    with pytest.raises(ConfigError, match="packed_gemm_rows=32 needs float32"):
        LLM(str(tiny_llama_dir), dtype="bfloat16", packed_gemm_rows=32)
    with pytest.raises(ConfigError, match="packed_gemm_rows"):
        LLM(str(tiny_llama_dir), packed_gemm_rows=-1)


def test_small_batch_gemm_is_off_until_enabled():
    gemm = SmallBatchGemm()
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(gemm(x, w, None), F.linear(x, w, None))
    assert gemm.packed is None
