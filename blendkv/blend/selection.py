"""Which reused tokens to recompute: pluggable scoring of candidate rows at a selection layer.

Every strategy scores the reused rows still being recomputed and keeps the top ``count``.
The deviation scores compare the fresh K or V of a row (computed from this request's context)
with the reused K/V loaded from the store (computed behind the anchor alone): rows whose K/V
changes most once they see the other chunks matter most (CacheBlend's HKVD tokens). K is
compared after RoPE on both sides, which equals the pre-RoPE distance (rotations preserve it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blendkv.kernels.attention_mass import query_attention_mass


@dataclass
class SelectionInputs:
    """One sequence's view at a selection layer.

    cand: [C] indices (into the step's current rows) of this sequence's reused rows.
    fresh_k / fresh_v: [C, Hkv, D] fresh K (RoPE applied) / V of those rows.
    cached_k / cached_v: [C, Hkv, D] the reused K (RoPE applied) / V of the same positions.
    query_q: [Q, H, D] fresh queries (RoPE applied) of the sequence's query rows, for the
        attention strategy; seq_k: [S, Hkv, D] keys of all the sequence's current rows and
        ``seq_k_positions`` / ``query_positions`` their positions (causal mask).
    """

    cand: torch.Tensor
    fresh_k: torch.Tensor
    fresh_v: torch.Tensor
    cached_k: torch.Tensor
    cached_v: torch.Tensor
    query_q: torch.Tensor | None = None
    seq_k: torch.Tensor | None = None
    seq_k_positions: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    cand_in_seq: torch.Tensor | None = None  # [C] index of each candidate within seq_k
    chunk_offsets: torch.Tensor | None = None  # [C] offset of each candidate in its chunk
    query_scores: torch.Tensor | None = None  # [C] prophet: attention mass over all layers


def score_rows(strategy: str, x: SelectionInputs, generator: torch.Generator) -> torch.Tensor:
    """Higher score = more worth recomputing. Returns [C] float32."""
    if strategy == "v_deviation":
        return (x.fresh_v.float() - x.cached_v.float()).pow(2).sum(dim=(1, 2))
    if strategy == "k_deviation":
        return (x.fresh_k.float() - x.cached_k.float()).pow(2).sum(dim=(1, 2))
    if strategy == "random":
        return torch.rand(len(x.cand), generator=generator)
    if strategy == "attention":
        return _attention_scores(x)
    if strategy == "heads":  # the first tokens of every chunk, round-robin over the chunks
        return -x.chunk_offsets.float()
    if strategy == "prophet":
        return x.query_scores.float()
    raise ValueError(f"unknown selection strategy {strategy!r}")


def _attention_scores(x: SelectionInputs) -> torch.Tensor:
    """Attention mass the query rows put on each candidate (summed over rows and heads)."""
    if x.query_q is None or len(x.query_q) == 0:
        return (x.fresh_v.float() - x.cached_v.float()).pow(2).sum(dim=(1, 2))
    weights = query_attention_mass(x.query_q, x.seq_k, x.query_positions, x.seq_k_positions)
    return weights[x.cand_in_seq]


def top_rows(scores: torch.Tensor, count: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (into the candidates) of the ``count`` best scores, in ascending order.

    ``forced`` (bool [C]): candidates always picked; they count against ``count`` (when they
    alone exceed it, all of them are picked and nothing else)."""
    count = max(0, min(count, len(scores)))
    if forced is not None and forced.any():
        scores = scores.float().masked_fill(forced, float("inf"))
        count = max(count, int(forced.sum()))
    if count == len(scores):
        return torch.arange(len(scores))
    return torch.topk(scores, count, sorted=False).indices.sort().values
