"""A decoder layer split at the points blending needs (after the input norm, after Q/K/V).

Mirrors ``LlamaDecoderLayer.forward`` (vLLM residual convention): the same modules, called in
the same order, so a row computed here equals the row the plain forward computes.
"""

from __future__ import annotations

import torch


def input_norm(layer, hidden: torch.Tensor, residual: torch.Tensor | None):
    """-> (normed hidden, residual) entering the attention block."""
    if residual is None:
        return layer.input_layernorm(hidden), hidden
    return layer.input_layernorm(hidden, residual)


def finish_layer(layer, attn_out: torch.Tensor, residual: torch.Tensor):
    """Attention output -> (hidden, residual) leaving the layer."""
    hidden, residual = layer.post_attention_layernorm(attn_out, residual)
    return layer.mlp(hidden), residual
