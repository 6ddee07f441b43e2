"""Chunk precompute: a plain prefill of ``context + chunk`` whose K/V is handed to the store
(the context: the anchor, or the anchor and the previous chunk's boundary).

It runs through the model's one forward path with no KV pool (dense metadata) and a layer hook
that keeps the chunk's own rows. One forward per chunk, on purpose: stored K/V is addressed by
content, so its bits must not depend on which chunks were computed beside it (a batched forward
changes the GEMMs' row count, and with it their rounding). The stored value
is ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``: index 0 is K *before* RoPE
(re-rotated at the fused positions when loaded), index 1 is V. The last layer stops after its
projections (``kv_only``): its attention and MLP outputs are never used.
"""

from __future__ import annotations

import torch

from blendkv.models.hooks import LayerHooks


class _ChunkKVSaver(LayerHooks):
    """Copies the chunk rows' fresh K (pre-RoPE) and V of every layer into one tensor."""

    def __init__(self, out: torch.Tensor, first_row: int) -> None:
        self.out = out
        self.first_row = first_row

    def save_kv_layer(self, layer_idx, k, v, kv_cache, attn_metadata) -> None:
        self.out[layer_idx, 0] = k[self.first_row :]
        self.out[layer_idx, 1] = v[self.first_row :]


@torch.inference_mode()
def compute_chunks_kv(
    model, attn_backend, contexts: list[list[int]], chunks: list[list[int]]
) -> list[torch.Tensor]:
    """K (pre-RoPE) and V of each chunk prefilled alone at positions after its context
    (``contexts[i]``: the anchor's ids, or the anchor plus the previous chunk's last ids)."""
    cfg = model.config
    attn = model.model.layers[0].self_attn
    dtype = model.model.embed_tokens.weight.dtype
    device = attn_backend.device
    outs = []
    for context, chunk in zip(contexts, chunks, strict=True):
        assert chunk, "empty chunks are rejected before precompute"
        ids = list(context) + list(chunk)
        out = torch.empty(
            cfg.num_hidden_layers, 2, len(chunk), attn.num_kv_heads, attn.head_dim,
            dtype=dtype, device=device,
        )  # fmt: skip
        md = attn_backend.dense_metadata([len(ids)])
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        saver = _ChunkKVSaver(out, len(context))
        model(input_ids, md.positions, None, md, hooks=saver, kv_only=True)
        outs.append(out)
    return outs
