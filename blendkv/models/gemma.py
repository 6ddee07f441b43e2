"""Gemma 2 and Gemma 3 (text): Llama's layer loop with Gemma's differences.

Both: embeddings scaled by ``sqrt(hidden_size)`` (in the model dtype), ``(1 + w)`` RMSNorms,
sandwich norms (the attention and MLP outputs are normed before the residual add, the MLP input
by ``pre_feedforward_layernorm``), softmax scale ``query_pre_attn_scalar ** -0.5``, a
``gelu_pytorch_tanh`` gated MLP, tied embeddings, final-logit soft-capping when the config sets
it, and sliding-window layers among global ones (``layer_types``).
Gemma 2 soft-caps attention scores (``attn_logit_softcapping``). Gemma 3 adds per-head ``(1 + w)``
q/k norms before RoPE, and its sliding layers rotate with their own base
(``rope_parameters["sliding_attention"]``, the old ``rope_local_base_freq``) while global layers
use ``rope_parameters["full_attention"]`` (with its scaling).
"""

from __future__ import annotations

import copy

import torch

from blendkv.errors import ModelLoadError
from blendkv.layers.mlp import GatedMLP
from blendkv.layers.norm import GemmaRMSNorm
from blendkv.layers.qk_norm import QKNormAttention
from blendkv.layers.rotary import RotaryEmbedding
from blendkv.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Gemma2DecoderLayer(LlamaDecoderLayer):
    norm_cls = GemmaRMSNorm
    applies_sliding_window = True

    def __init__(self, config, layer_idx, rotary_emb, attn_backend, qkv_bias, o_bias) -> None:
        super().__init__(config, layer_idx, rotary_emb, attn_backend, qkv_bias, o_bias)
        self.pre_feedforward_layernorm = self.make_norm(config)
        self.post_feedforward_layernorm = self.make_norm(config)

    def make_mlp(self, config) -> GatedMLP:
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        return GatedMLP(config.hidden_size, config.intermediate_size, act)

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        kwargs = super().attention_kwargs(config, layer_idx)
        kwargs["scaling"] = config.query_pre_attn_scalar**-0.5
        cap = getattr(config, "attn_logit_softcapping", None)
        if cap:
            kwargs["logits_soft_cap"] = cap
        return kwargs

    def finish(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sandwich norms: post-attention norm, residual add inside the pre-MLP norm, MLP,
        post-MLP norm (its residual add happens in the next norm)."""
        attn_out = self.post_attention_layernorm(attn_out)
        hidden_states, residual = self.pre_feedforward_layernorm(attn_out, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2Model(LlamaModel):
    decoder_layer_cls = Gemma2DecoderLayer

    def __init__(self, config, attn_backend, qkv_bias: bool, o_bias: bool) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError(
                "Gemma with use_bidirectional_attention (an embedding model) is not a causal LM"
            )
        super().__init__(config, attn_backend, qkv_bias, o_bias)
        # transformers: a float32 scalar cast to the weights' dtype, then multiplied.
        self.embed_scale = float(config.hidden_size) ** 0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        scale = torch.tensor(self.embed_scale, dtype=torch.float32, device=hidden_states.device)
        return hidden_states * scale.to(hidden_states.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma2Model


def rope_config(config, layer_type: str):
    """A shallow copy of ``config`` whose ``rope_parameters`` are those of ``layer_type``
    (Gemma 3 keeps one dict per layer type), for :class:`RotaryEmbedding`."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type not in params:
        return config  # one dict for every layer (older configs)
    view = copy.copy(config)
    view.rope_parameters = dict(params[layer_type])
    return view


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = QKNormAttention

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        return {**super().attention_kwargs(config, layer_idx), "qk_norm_cls": GemmaRMSNorm}


class Gemma3Model(Gemma2Model):
    """``rotary_emb`` is the global layers' RoPE, ``rotary_emb_local`` the sliding layers'."""

    decoder_layer_cls = Gemma3DecoderLayer

    def make_rotary(self, config) -> RotaryEmbedding:
        self.rotary_emb_local = RotaryEmbedding(rope_config(config, "sliding_attention"))
        return RotaryEmbedding(rope_config(config, "full_attention"))

    def layer_rotary(self, config, layer_idx: int) -> RotaryEmbedding:
        types = getattr(config, "layer_types", None)
        if types is not None and types[layer_idx] == "sliding_attention":
            return self.rotary_emb_local
        return self.rotary_emb


class Gemma3ForCausalLM(LlamaForCausalLM):
    """``Gemma3ForCausalLM`` text checkpoints (model_type ``gemma3_text``); the multimodal
    ``Gemma3ForConditionalGeneration`` is not loaded."""

    model_cls = Gemma3Model
