"""RoPE and RMSNorm against transformers' own Llama modules, at scattered positions."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama as hf_llama

from blendkv.layers.norm import RMSNorm
from blendkv.layers.rotary import RotaryEmbedding

ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "llama3": dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
    # yarn has attention_factor != 1: cos/sin are scaled, not just the frequencies.
    "yarn": dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64
    ),
}


def _config(rope: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters=dict(rope),
    )


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_hf(rope, dtype):
    config = _config(ROPES[rope])
    ours = RotaryEmbedding(config)
    hf = hf_llama.LlamaRotaryEmbedding(config)
    if rope == "yarn":
        assert ours.attention_scaling != 1.0
    positions = torch.tensor([0, 3, 2, 200, 17, 255, 64])  # scattered, unsorted
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 16, generator=gen).to(dtype)
    k = torch.randn(7, 2, 16, generator=gen).to(dtype)
    cos, sin = hf(q, positions[None])  # [1, T, D]
    # HF layout is [B, heads, T, D]; ours is [T, heads, D].
    hq, hk = hf_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    q_rot, k_rot = ours.apply_rotary(positions, q, k)
    assert q_rot.dtype == dtype
    torch.testing.assert_close(q_rot, hq[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(k_rot, hk[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(ours.rotate_k(positions, k), k_rot, atol=0, rtol=0)


def test_rotate_k_moves_keys_between_positions():
    """Rotating by p then by d equals rotating by p + d (what re-rotating stored K relies on
    when K is kept pre-RoPE: rotate once, at the new position)."""
    ours = RotaryEmbedding(_config(ROPES["default"]))
    k = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(0))
    p = torch.tensor([0, 1, 2, 3, 4])
    twice = ours.rotate_k(p + 10, k)
    once_shifted = ours.rotate_k(torch.full_like(p, 10), ours.rotate_k(p, k))
    torch.testing.assert_close(twice, once_shifted, atol=1e-5, rtol=0)
    assert not torch.allclose(ours.rotate_k(p, k), twice)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_with_fused_residual(dtype):
    gen = torch.Generator().manual_seed(0)
    weight = 1 + 0.3 * torch.randn(64, generator=gen)
    ours, hf = RMSNorm(64, eps=1e-5), hf_llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = (3 * torch.randn(9, 64, generator=gen)).to(dtype)
    residual = torch.randn(9, 64, generator=gen).to(dtype)
    torch.testing.assert_close(ours(x), hf(x), atol=0, rtol=0)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, hf(x + residual), atol=0, rtol=0)
