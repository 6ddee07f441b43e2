"""Llama (Llama 3.x rope scaling, Mistral's sliding window) and Qwen2 through the parity gate
(tests/models/parity.py)."""

from __future__ import annotations

import pytest
import transformers
from parity import TINY, WINDOW, Family, ParityGate

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)

FAMILIES = {
    "llama3": Family(
        "llama3",
        lambda: transformers.LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE),
        transformers.LlamaForCausalLM,
    ),
    "mistral-window": Family(
        "mistral-window",
        lambda: transformers.MistralConfig(**TINY, sliding_window=WINDOW),
        transformers.MistralForCausalLM,
    ),
    "qwen2": Family(
        "qwen2",
        lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
        transformers.Qwen2ForCausalLM,
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
