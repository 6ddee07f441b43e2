"""Qwen2: Llama's architecture with biases on q/k/v_proj (none on o_proj); ``sliding_window``
(off unless ``use_sliding_window``) on the layers ``layer_types`` marks ``sliding_attention``."""

from __future__ import annotations

from blendkv.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen2DecoderLayer(LlamaDecoderLayer):
    applies_sliding_window = True


class Qwen2Model(LlamaModel):
    decoder_layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model

    @staticmethod
    def attention_bias(config) -> tuple[bool, bool]:
        return True, False
