"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layer with fused checkpoint weights, ``longrope`` and
partial rotary (:mod:`blendkv.layers.rotary`), ``sliding_window`` on every layer.

The checkpoint's ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` are split at load into the
existing ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` parameters (which the
loader fuses again into one GEMM each), so the layer code is Llama's. With partial rotary the
q/k rows are put in the rotary table's head layout on the way
(:meth:`~blendkv.layers.rotary.RotaryEmbedding.to_head_layout`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from blendkv.layers.rotary import head_dim_of
from blendkv.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

_QKV = "self_attn.qkv_proj."
_GATE_UP = "mlp.gate_up_proj."


class Phi3DecoderLayer(LlamaDecoderLayer):
    applies_sliding_window = True


class Phi3Model(LlamaModel):
    decoder_layer_cls = Phi3DecoderLayer


class Phi3ForCausalLM(LlamaForCausalLM):
    model_cls = Phi3Model

    @staticmethod
    def attention_bias(config) -> tuple[bool, bool]:
        return False, False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Split the fused checkpoint tensors by name, then load as Llama does."""
        super().load_weights(self.split_fused(weights))

    def split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``...qkv_proj.{weight,bias}`` -> ``q_proj``/``k_proj``/``v_proj`` (q and k in the
        rotary head layout), ``...gate_up_proj.weight`` -> ``gate_proj``/``up_proj``; other
        entries pass through."""
        config = self.config
        head_dim = head_dim_of(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        for name, tensor in weights:
            if _QKV in name:
                prefix, _, suffix = name.partition(_QKV)
                layer = int(prefix.rstrip(".").rsplit(".", 1)[1])
                rotary = self.model.layer_rotary(config, layer)
                if tensor.shape[0] != sum(sizes):  # let the shape check name it
                    yield name, tensor
                    continue
                q, k, v = tensor.split(sizes)
                yield f"{prefix}self_attn.q_proj.{suffix}", _layout(rotary, q, heads)
                yield f"{prefix}self_attn.k_proj.{suffix}", _layout(rotary, k, kv_heads)
                yield f"{prefix}self_attn.v_proj.{suffix}", v
            elif _GATE_UP in name:
                prefix, _, suffix = name.partition(_GATE_UP)
                if tensor.shape[0] % 2:
                    yield name, tensor
                    continue
                gate, up = tensor.chunk(2)
                yield f"{prefix}mlp.gate_proj.{suffix}", gate
                yield f"{prefix}mlp.up_proj.{suffix}", up
            else:
                yield name, tensor


def _layout(rotary, rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    if not rotary.is_partial:
        return rows
    # In float32 (one rounding, at the cast to the model's dtype).
    return rotary.to_head_layout(rows.float(), num_heads)
