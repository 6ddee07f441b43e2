"""Phi-3 and Phi-4-mini parity gates (tests/models/parity.py): fused qkv/gate-up checkpoint
tensors split at load, ``sliding_window`` on every layer, ``longrope`` with partial rotary
(Phi-4-mini's 0.75); prompts stay below ``original_max_position_embeddings`` (short factors:
the long ones are checked against transformers' tables in test_rotary_scaling.py)."""

from __future__ import annotations

import pytest
import transformers
from parity import TINY, WINDOW, Family, ParityGate


def phi_rename(name: str) -> list[str]:
    """A Phi-3 checkpoint key -> blendkv's parameter names (fused tensors are split)."""
    if "qkv_proj" in name:
        return [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    if "gate_up_proj" in name:
        return [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
    return [name]


def longrope(partial: float) -> dict:
    rotary = int(TINY["head_dim"] * partial) // 2
    return dict(
        rope_type="longrope",
        rope_theta=10000.0,
        partial_rotary_factor=partial,
        short_factor=[1.0 + 0.3 * i for i in range(rotary)],
        long_factor=[2.0 + 0.5 * i for i in range(rotary)],
    )


FAMILIES = {
    "phi3": Family(
        "phi3",
        lambda: transformers.Phi3Config(**TINY, sliding_window=WINDOW),
        transformers.Phi3ForCausalLM,
        phi_rename,
    ),
    "phi4-mini": Family(
        "phi4-mini",
        lambda: transformers.Phi3Config(
            **{**TINY, "max_position_embeddings": 1024},
            original_max_position_embeddings=256,
            rope_parameters=longrope(0.75),
            tie_word_embeddings=True,
        ),
        transformers.Phi3ForCausalLM,
        phi_rename,
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gate(request, tmp_path_factory) -> ParityGate:
    return ParityGate(FAMILIES[request.param], tmp_path_factory.mktemp(request.param))


def test_dense(gate):
    gate.check_dense()


def test_engine(gate):
    gate.check_engine()


def test_triton(gate):
    gate.check_triton()
