"""Mistral's ``sliding_window`` is applied on every layer (the parity gate with a window is in
test_parity_llama_qwen2.py); without one the layers are global; a window one token off
changes the logits, so the gate can fail."""

from __future__ import annotations

import pytest
import torch
import transformers
from parity import ATOL, TINY, WINDOW, randomize

from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.models.llama import MistralForCausalLM
from blendkv.models.model_files import load_model, resolve_model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    config = transformers.MistralConfig(**TINY, sliding_window=WINDOW)
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(config).eval()
    randomize(hf)
    path = tmp_path_factory.mktemp("mistral")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), None, None))


def test_every_layer_windowed(mistral):
    _, path = mistral
    ours = load_model(resolve_model(path), torch.float32, TorchAttentionBackend())
    assert isinstance(ours, MistralForCausalLM)
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [WINDOW] * 2
    unwindowed = transformers.MistralConfig(**TINY, sliding_window=None)
    model = MistralForCausalLM(unwindowed, TorchAttentionBackend())
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None] * 2


@pytest.mark.parametrize("delta", [0, -1, 1])
def test_window_matches_transformers_only_when_exact(mistral, delta):
    hf, path = mistral
    ours = load_model(resolve_model(path), torch.float32, TorchAttentionBackend())
    for layer in ours.model.layers:
        layer.self_attn.sliding_window += delta
    ids = torch.randint(2, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    error = (_logits(ours, ids) - expected).abs().max()
    assert error < ATOL if delta == 0 else error > 100 * ATOL
