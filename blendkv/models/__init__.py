"""Model families (Llama/Mistral/SmolLM2, Qwen2), the registry and the local-only loader."""

from blendkv.models.llama import LlamaForCausalLM
from blendkv.models.model_files import (
    ResolvedModel,
    load_model,
    load_tokenizer,
    resolve_model,
    weights_hash,
)
from blendkv.models.qwen2 import Qwen2ForCausalLM
from blendkv.models.registry import get_model_class

__all__ = [
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "ResolvedModel",
    "get_model_class",
    "load_model",
    "load_tokenizer",
    "resolve_model",
    "weights_hash",
]
