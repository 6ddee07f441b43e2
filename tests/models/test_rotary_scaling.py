"""RoPE tables against transformers' rotary embeddings: ``llama3``, ``linear``, ``dynamic``,
``longrope`` (short factors below the original context, long ones past it) with partial rotary;
unknown rope types are refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from parity import TINY

from blendkv.errors import ModelLoadError
from blendkv.layers.rotary import RotaryEmbedding


def hf_cos_sin(hf_config, hf_rope_cls, positions: torch.Tensor):
    rope = hf_rope_cls(hf_config)
    return rope(torch.zeros(1, len(positions), 1), positions[None])


def phi_config(partial: float) -> transformers.Phi3Config:
    rotary = int(TINY["head_dim"] * partial) // 2
    return transformers.Phi3Config(
        **{**TINY, "max_position_embeddings": 64},
        original_max_position_embeddings=16,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            partial_rotary_factor=partial,
            short_factor=[1.0 + 0.3 * i for i in range(rotary)],
            long_factor=[2.0 + 0.5 * i for i in range(rotary)],
        ),
    )


@pytest.mark.parametrize("partial", [1.0, 0.75, 0.5])
def test_longrope_short_then_long_factors(partial):
    """Positions below ``original_max_position_embeddings`` rotate as transformers does for a
    short sequence, the others as it does once the sequence is long."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = phi_config(partial)
    ours = RotaryEmbedding(config)
    r, h = ours.rotary_dim, ours.head_dim // 2
    assert r == int(16 * partial) and ours.attention_scaling > 1.0
    short = torch.arange(16)
    long = torch.arange(40)  # its length picks the long factors for every position
    for positions, rows in ((short, slice(0, 16)), (long, slice(16, 40))):
        cos, sin = hf_cos_sin(config, Phi3RotaryEmbedding, positions)
        cos, sin = cos[0, rows], sin[0, rows]  # [n, r]
        table_cos, table_sin = ours.tables("cpu")
        for table, ref in ((table_cos, cos), (table_sin, sin)):
            mine = table[positions[rows]]
            # pairs (j, j + h) here are (i, i + r/2) there
            torch.testing.assert_close(mine[:, : r // 2], ref[:, : r // 2], atol=0, rtol=0)
            torch.testing.assert_close(mine[:, h : h + r // 2], ref[:, r // 2 :], atol=0, rtol=0)
    # pass-through dims: x * scaling (their weights are divided by it), no rotation
    assert torch.all(table_cos[:, r // 2 : h] == ours.attention_scaling)
    assert torch.all(table_sin[:, r // 2 : h] == 0)


def test_partial_rotary_head_layout_preserves_scores():
    """q.k after RoPE in the head layout equals transformers' partial rotary on the checkpoint
    rows (random q/k at scattered positions)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = phi_config(0.75)
    ours = RotaryEmbedding(config)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 1, 16, generator=gen)  # [T, heads=1, D]
    positions = torch.tensor([0, 3, 15, 21, 33])  # short and long: compare per set
    for sel in (positions < 16, positions >= 16):
        pos = positions[sel]
        span = torch.arange(int(pos.max()) + 1 if sel[0] else 40)
        cos, sin = hf_cos_sin(config, Phi3RotaryEmbedding, span)
        qh, kh = apply_rotary_pos_emb(
            q[sel].transpose(0, 1)[None], k[sel].transpose(0, 1)[None], cos[:, pos], sin[:, pos]
        )
        expected = torch.einsum("td,sd->ts", qh[0, 0], kh[0, 0])
        ql = ours.to_head_layout(q[sel].reshape(-1, 16).T.contiguous(), 1).T.reshape(-1, 1, 16)
        kl = ours.to_head_layout(k[sel].reshape(-1, 16).T.contiguous(), 1).T.reshape(-1, 1, 16)
        qr, kr = ours.apply_rotary(pos, ql, kl)
        got = torch.einsum("td,sd->ts", qr[:, 0], kr[:, 0])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        # stored K comes back pre-RoPE (the chunk store and blending's K correction)
        torch.testing.assert_close(ours.unrotate_k(pos, kr), kl, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="linear", factor=4.0),
        # within max_position_embeddings (256) transformers keeps the original frequencies too
        dict(rope_type="dynamic", factor=4.0),
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ],
)
def test_llama_rope_scaling_matches_transformers(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(**TINY, rope_parameters=dict(rope, rope_theta=10000.0))
    ours = RotaryEmbedding(config)
    positions = torch.arange(200)
    cos, sin = hf_cos_sin(config, LlamaRotaryEmbedding, positions)
    table_cos, table_sin = ours.tables("cpu")
    torch.testing.assert_close(table_cos[:200], cos[0], atol=0, rtol=0)
    torch.testing.assert_close(table_sin[:200], sin[0], atol=0, rtol=0)


def test_unknown_rope_type_is_a_model_load_error():
    config = transformers.LlamaConfig(**TINY)
    config.rope_parameters = {"rope_type": "mystery", "rope_theta": 10000.0}
    with pytest.raises(ModelLoadError, match="rope_type 'mystery' is not supported.*llama3"):
        RotaryEmbedding(config)
