"""Qwen3's parity gate (tests/models/parity.py): per-head q/k RMSNorm, no window; and with
``use_sliding_window`` on its upper layers (``max_window_layers``)."""

from __future__ import annotations

import pytest
import torch
import transformers
from parity import TINY, WINDOW, Family, ParityGate

from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.models.model_files import load_model, resolve_model

FAMILIES = {
    "qwen3": Family(
        "qwen3",
        lambda: transformers.Qwen3Config(**TINY),
        transformers.Qwen3ForCausalLM,
    ),
    "qwen3-window": Family(
        "qwen3-window",
        lambda: transformers.Qwen3Config(
            **TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        transformers.Qwen3ForCausalLM,
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


def test_window_layers(gate):
    """Layers from ``max_window_layers`` on are windowed (transformers' ``layer_types``)."""
    ours = load_model(resolve_model(gate.path), torch.float32, TorchAttentionBackend())
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers]
    assert windows == ([None, WINDOW] if gate.hf.config.use_sliding_window else [None, None])
