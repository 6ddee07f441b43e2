"""The attention mass query rows pay each key (ProphetKV's and the ``attention`` selection's
score), dense torch: the reference for the Triton kernels of :mod:`.triton.query_mass`, and
on the CPU the query rows' attention itself (:func:`attention_with_mass`: one product of q and
K gives both the rows' output and the score)."""

from __future__ import annotations

import torch

# attention_with_mass: query rows per block, so a block's probabilities stay near this many
# float32 values (16 MiB, held in a server CPU's last-level cache between the products; larger
# blocks ran slower, docs/benchmarks.md).
_MAX_PROBS = 1 << 22


def _query_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    visible_prefix: int,
    scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Softmax attention [Hkv, G * Q, S] float32 of ``q`` [Q, H, D] over ``k`` [S, Hkv, D]:
    query heads grouped by the KV head they share (GQA: no copy of K per query head), rows
    g-major, so the scores are one batched GEMM.

    ``scale`` (None: ``D ** -0.5``), ``window`` (a row at ``p`` sees keys ``p - window < j <=
    p``) and ``soft_cap`` (logits ``cap * tanh(logits / cap)``) as the model's layer has them."""
    num_q, num_heads, dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    qg = (q.float() * (dim**-0.5 if scale is None else scale)).view(num_q, num_kv, group, dim)
    qg = qg.permute(1, 2, 0, 3)
    logits = torch.bmm(qg.reshape(num_kv, group * num_q, dim), k.float().permute(1, 2, 0))
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    if window is not None:
        visible_prefix = 0  # a window hides leading keys too
    hidden = k_positions[None, visible_prefix:] > q_positions[:, None]  # [Q, S - prefix]
    if window is not None:
        hidden |= k_positions[None, :] <= q_positions[:, None] - window
    logits[:, :, visible_prefix:].masked_fill_(hidden.repeat(group, 1), float("-inf"))
    return logits.softmax(dim=-1)


def query_attention_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    visible_prefix: int = 0,
    *,
    scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """q [Q, H, D] and k [S, Hkv, D] (RoPE applied) -> [S]: the softmax attention each key
    gets, summed over the query rows and heads (a row sees keys at positions <= its own).

    ``visible_prefix``: how many leading keys every query row sees (the caller knows it without
    a device sync); only the keys after them are masked. ``scale``/``window``/``soft_cap``: the
    layer's (:func:`_query_probs`)."""
    probs = _query_probs(q, k, q_positions, k_positions, visible_prefix, scale, window, soft_cap)
    return probs.sum(dim=(0, 1))  # [S]


def attention_with_mass(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    visible_prefix: int = 0,
    *,
    scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query rows and the mass they pay each key, from one product of q and K.

    ``q`` [Q, H, D] (RoPE applied) at ``q_positions``; ``keys``/``values`` [S, Hkv, D] at
    positions ``0..S-1``; scale ``D ** -0.5`` unless given; ``window``/``soft_cap`` as
    :func:`_query_probs`. With them it is the dense oracle of windowed and soft-capped
    attention (the torch backend's path for such layers). Returns the rows' output [Q, H, D]
    (q's dtype) and :func:`query_attention_mass` of the same rows, [S] float32 (the same bits
    when the rows fit one block). Rows go in blocks that keep the probabilities near ``_MAX_PROBS``
    values."""
    num_q, num_heads, dim = q.shape
    num_kv = keys.shape[1]
    group = num_heads // num_kv
    seq_len = keys.shape[0]
    k_positions = torch.arange(seq_len, device=keys.device)
    v = values.float().permute(1, 0, 2)  # [Hkv, S, D]
    out = torch.empty_like(q)
    mass = torch.zeros(seq_len, dtype=torch.float32, device=keys.device)
    step = max(1, _MAX_PROBS // (num_heads * max(seq_len, 1)))
    for lo in range(0, num_q, step):
        hi = min(num_q, lo + step)
        probs = _query_probs(
            q[lo:hi],
            keys,
            q_positions[lo:hi],
            k_positions,
            visible_prefix,
            scale,
            window,
            soft_cap,
        )
        mass += probs.sum(dim=(0, 1))
        o = torch.bmm(probs, v)  # [Hkv, G * rows, D]
        rows = hi - lo
        out[lo:hi] = o.view(num_kv, group, rows, dim).permute(2, 0, 1, 3).reshape(rows, -1, dim)
    return out, mass
