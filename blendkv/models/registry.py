"""Model class lookup from a transformers config (``architectures[0]``, else ``model_type``)."""

from __future__ import annotations

from torch import nn

from blendkv.errors import ModelLoadError
from blendkv.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from blendkv.models.llama import LlamaForCausalLM, MistralForCausalLM
from blendkv.models.phi3 import Phi3ForCausalLM
from blendkv.models.qwen2 import Qwen2ForCausalLM
from blendkv.models.qwen3 import Qwen3ForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_MODEL_TYPES: dict[str, str] = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
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
