"""Model class lookup from a transformers config (``architectures[0]``, else ``model_type``)."""

from __future__ import annotations

from torch import nn

from blendkv.errors import ModelLoadError
from blendkv.models.llama import LlamaForCausalLM
from blendkv.models.qwen2 import Qwen2ForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(hf_config) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    if archs and archs[0] in _ARCHITECTURES:
        return _ARCHITECTURES[archs[0]]
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _MODEL_TYPES:
        return _ARCHITECTURES[_MODEL_TYPES[model_type]]
    raise ModelLoadError(
        f"unsupported model (architectures={archs or None}, model_type={model_type!r}); "
        f"blendkv supports {', '.join(supported_architectures())}"
    )
