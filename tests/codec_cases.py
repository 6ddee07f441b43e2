"""Encoded chunks for the decode-at-load kernel tests: random K/V with an outlier channel,
encoded by ``blendkv.store.codecs.encode``; outlier heads chosen by hand where asked."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from blendkv.kernels.kv_dequant import EncodedChunk
from blendkv.store.codecs import encode


def encoded_chunk(
    codec: str,
    dtype: torch.dtype,
    *,
    layers: int = 3,
    tokens: int = 37,
    heads: int = 2,
    head_dim: int = 8,
    outliers: bool = False,
    seed: int = 0,
) -> EncodedChunk:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, tokens, heads, head_dim, generator=gen) * 3
    kv[:, 0, :, :, 1] *= 20  # an outlier channel in K
    kv = kv.to(dtype)
    enc = encode(kv, codec, outlier_threshold=math.inf)
    if outliers:
        mask = torch.zeros(layers, heads, dtype=torch.bool)
        mask[0, 1] = mask[layers - 1, 0] = mask[layers - 1, heads - 1] = True
        keys = kv[:, 0].permute(0, 2, 1, 3)[mask].contiguous()
        enc = replace(enc, outlier_heads=mask, outlier_k=keys)
    return EncodedChunk(enc)


def rotary_tables(positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float().contiguous(), angles.sin().float().contiguous()
