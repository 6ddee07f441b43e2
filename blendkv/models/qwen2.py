"""Qwen2: Llama's architecture with biases on q/k/v_proj (none on o_proj)."""

from __future__ import annotations

from blendkv.errors import ModelLoadError
from blendkv.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, attn_backend) -> None:
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) and "sliding_attention" in layer_types:
            raise ModelLoadError("Qwen2 sliding-window attention layers are not supported")
        super().__init__(config, attn_backend)

    @staticmethod
    def attention_bias(config) -> tuple[bool, bool]:
        return True, False
