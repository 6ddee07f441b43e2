"""Chunk precompute: prefill one chunk alone behind the anchor and keep only its own K/V.

The stored value is ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``: index 0 is K
*before* RoPE (re-rotated at the fused positions when loaded), index 1 is V.
"""

from __future__ import annotations

import torch

from blendkv.blend.layer_ops import finish_layer, input_norm


@torch.inference_mode()
def compute_chunk_kv(model, anchor_ids: list[int], chunk_ids: list[int]) -> torch.Tensor:
    """K (pre-RoPE) and V of ``chunk_ids`` prefilled at positions after ``anchor_ids``."""
    assert chunk_ids, "empty chunks are rejected before precompute"
    inner = model.model
    ids = torch.tensor(list(anchor_ids) + list(chunk_ids), dtype=torch.long)
    positions = torch.arange(len(ids))
    a = len(anchor_ids)
    first = inner.layers[0].self_attn
    dtype = inner.embed_tokens.weight.dtype
    out = torch.empty(
        len(inner.layers), 2, len(chunk_ids), first.num_kv_heads, first.head_dim, dtype=dtype
    )
    hidden, residual = inner.embed_tokens(ids), None
    last = len(inner.layers) - 1
    for i, layer in enumerate(inner.layers):
        normed, residual = input_norm(layer, hidden, residual)
        q, k, v = layer.self_attn.project(normed)
        out[i, 0] = k[a:]
        out[i, 1] = v[a:]
        if i == last:
            break  # the last layer's output is not needed
        attn = layer.self_attn.attend(positions, q, k, v, None, None)
        hidden, residual = finish_layer(layer, attn, residual)
    return out
