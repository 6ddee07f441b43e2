"""The model registry: each supported family by architecture and by model type; anything else
is a ModelLoadError that lists what is supported."""

from __future__ import annotations

import pytest
import transformers

from blendkv.errors import ModelLoadError
from blendkv.models.phi3 import Phi3ForCausalLM
from blendkv.models.qwen3 import Qwen3ForCausalLM
from blendkv.models.registry import get_model_class, supported_architectures


@pytest.mark.parametrize(
    ("config", "cls"),
    [
        (transformers.Qwen3Config(), Qwen3ForCausalLM),
        (transformers.Phi3Config(), Phi3ForCausalLM),
    ],
)
def test_new_families_by_architecture_and_model_type(config, cls):
    assert get_model_class(config) is cls  # no architectures: by model_type
    config.architectures = [cls.__name__]
    assert get_model_class(config) is cls


def test_unsupported_architecture_lists_the_supported_ones():
    config = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError) as e:
        get_model_class(config)
    message = str(e.value)
    assert "GPT2LMHeadModel" in message
    for arch in ("LlamaForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in message and arch in supported_architectures()
