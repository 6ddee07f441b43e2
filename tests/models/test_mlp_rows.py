"""MLP passes in row slices (``EngineConfig.mlp_rows_per_pass``, GatedMLP.rows_per_pass): equal
slices of at most the limit, the rows' values of one pass, the engine's CPU default from the
byte budget and the same greedy tokens end to end."""

from __future__ import annotations

import pytest
import torch

from blendkv import LLM, SamplingParams
from blendkv.engine.cpu_speedups import MLP_PASS_BYTES, setup_mlp_rows
from blendkv.errors import ConfigError
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


def test_setup_sizes_passes_from_the_byte_budget_on_the_cpu_only():
    model = torch.nn.ModuleList([_mlp(False), _mlp(True)])
    row_bytes = 2 * 80 * 4
    assert setup_mlp_rows(model, None, torch.float32, "cpu") == MLP_PASS_BYTES // row_bytes
    assert all(m.rows_per_pass == MLP_PASS_BYTES // row_bytes for m in model)
    assert setup_mlp_rows(model, None, torch.bfloat16, "cpu") == MLP_PASS_BYTES // (row_bytes // 2)
    assert setup_mlp_rows(model, 0, torch.float32, "cpu") == 0
    assert all(m.rows_per_pass is None for m in model)
    assert setup_mlp_rows(model, 96, torch.float32, "cuda") == 96  # asked for: set anywhere
    assert setup_mlp_rows(model, None, torch.float32, "cuda") == 0  # the caching allocator


def test_engine_slices_prefill_rows_with_the_same_greedy_tokens(tiny_llama_dir):
    assert LLM(str(tiny_llama_dir), dtype="float32").engine.mlp_rows_per_pass > 0
    prompts = [[3 + (7 * i) % 50 for i in range(90)], [5, 9, 11] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    results = {}
    for rows in (0, 8):
        llm = LLM(str(tiny_llama_dir), dtype="float32", mlp_rows_per_pass=rows)
        assert llm.engine.mlp_rows_per_pass == rows
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


@pytest.mark.parametrize("rows", [-1, 1.5])
def test_bad_rows_per_pass_is_a_config_error(tiny_llama_dir, rows):
    with pytest.raises(ConfigError, match="mlp_rows_per_pass"):
        LLM(str(tiny_llama_dir), mlp_rows_per_pass=rows)
