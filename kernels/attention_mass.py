"""The attention mass query rows pay each key (ProphetKV's and the ``attention`` selection's
score), dense torch: the reference for the Triton kernels of :mod:`.triton.query_mass`."""

from __future__ import annotations

import torch


def query_attention_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    visible_prefix: int = 0,
) -> torch.Tensor:
    """q [Q, H, D] and k [S, Hkv, D] (RoPE applied) -> [S]: the softmax attention each key
    gets, summed over the query rows and heads (a row sees keys at positions <= its own).

    ``visible_prefix``: how many leading keys every query row sees (the caller knows it without
    a device sync); only the keys after them are masked."""
    num_q, num_heads, dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    # Query heads grouped by the KV head they share (GQA: no copy of K per query head), rows
    # g-major: [Hkv, G * Q, D] @ [Hkv, D, S], one batched GEMM.
    qg = (q.float() * dim**-0.5).view(num_q, num_kv, group, dim).permute(1, 2, 0, 3)
    logits = torch.bmm(qg.reshape(num_kv, group * num_q, dim), k.float().permute(1, 2, 0))
    hidden = k_positions[None, visible_prefix:] > q_positions[:, None]  # [Q, S - prefix]
    logits[:, :, visible_prefix:].masked_fill_(hidden.repeat(group, 1), float("-inf"))
    return logits.softmax(dim=-1).sum(dim=(0, 1))  # [S]
