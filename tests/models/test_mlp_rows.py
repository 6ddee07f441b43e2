"""MLP passes in row slices (GatedMLP.rows_per_pass, set by
:mod:`blendkv.layers.cpu_platform`): equal slices of at most the limit, the rows' values of one
pass, the engine's CPU default from the byte budget and the same greedy tokens end to end."""

from __future__ import annotations

import pytest
import torch
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.layers.cpu_platform import (
    MLP_PASS_BYTES,
    CpuTuning,
    apply_cpu_tuning,
    mlp_rows_per_pass,
)
from blendkv.layers.mlp import GatedMLP


def _mlp(fused: bool) -> GatedMLP:
    torch.manual_seed(0)
    mlp = GatedMLP(48, 80)
    if fused:
        mlp.fuse()
    return mlp


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    ("n", "slices"), [(7, [7]), (16, [16]), (17, [9, 8]), (50, [13] * 3 + [11])]
)
def test_rows_run_in_equal_slices_with_one_pass_values(fused, n, slices):
    mlp = _mlp(fused)
    x = torch.randn(n, 48)
    whole = mlp(x)
    seen = []
    mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    mlp.rows_per_pass = 16
    out = mlp(x)
    assert seen == slices
    assert out.shape == whole.shape and out.dtype == whole.dtype
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)


def test_passes_are_sized_from_the_byte_budget_on_the_cpu_only():
    model = torch.nn.ModuleList([_mlp(False), _mlp(True)])
    row_bytes = 2 * 80 * 4
    assert mlp_rows_per_pass(model, torch.float32, "cpu") == MLP_PASS_BYTES // row_bytes
    assert mlp_rows_per_pass(model, torch.bfloat16, "cpu") == MLP_PASS_BYTES // (row_bytes // 2)
    assert mlp_rows_per_pass(model, torch.float32, "cuda") == 0  # the caching allocator
    apply_cpu_tuning(model, CpuTuning("torch", 0, 96))
    assert all(m.rows_per_pass == 96 for m in model)
    apply_cpu_tuning(model, CpuTuning("torch", 0, 0))
    assert all(m.rows_per_pass is None for m in model)


def test_engine_slices_prefill_rows_with_the_same_greedy_tokens(tiny_llama_dir):
    assert QuietLLM(str(tiny_llama_dir), dtype="float32").engine.cpu_tuning.mlp_rows_per_pass > 0
    prompts = [[3 + (7 * i) % 50 for i in range(90)], [5, 9, 11] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    results = {}
    for rows in (0, 8):
        llm = QuietLLM(str(tiny_llama_dir), dtype="float32")
        tuning = llm.engine.cpu_tuning
        apply_cpu_tuning(llm.engine.model, CpuTuning(tuning.gemm, tuning.packed_gemm_rows, rows))
        down = llm.engine.model.model.layers[0].mlp.down_proj
        seen = []
        down.register_forward_hook(lambda m, args, out, seen=seen: seen.append(args[0].shape[0]))
        results[rows] = llm.generate(prompts, params)
        assert (max(seen) <= 8) == (rows == 8)
        llm.close()
    for a, b in zip(results[0], results[8], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for tok in la:
                assert la[tok] == pytest.approx(lb[tok], abs=1e-4)
