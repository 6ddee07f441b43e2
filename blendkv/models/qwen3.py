"""Qwen3 (dense): Llama's layer with per-head RMSNorm on q and k before RoPE, an explicit
``head_dim``, no q/k/v bias. ``sliding_window`` (off unless ``use_sliding_window``) is applied
on the layers ``layer_types`` marks ``sliding_attention``."""

from __future__ import annotations

from blendkv.layers.qk_norm import QKNormAttention
from blendkv.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = QKNormAttention
    applies_sliding_window = True


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
