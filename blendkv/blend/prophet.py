"""ProphetKV's first stage (arXiv 2602.02579): which chunk tokens does the query need?

Before the fused forward, a pass of only the rows without reused K/V (template, query) runs
through every layer over the reused K/V already loaded into the blocks: a few dozen rows, so
cheap. At each layer the attention the query rows (positions from ``query_start`` on) pay each
position is summed over heads and rows, and over layers. The fused forward then recomputes the
top-scored reused rows from layer 0 (``selection="prophet"``, :class:`BlendRowPlan`). The pass
writes the non-reused rows' K/V at every layer; the fused forward computes and overwrites them.
It runs through the model's one layer loop with :class:`QueryScorePlan` as its row plan.
"""

from __future__ import annotations

import torch

from blendkv.blend.row_plan import SeqBlend
from blendkv.blend.selection import query_attention_mass
from blendkv.models.hooks import RowPlan


def needs_query_pass(sb: SeqBlend) -> bool:
    cfg = sb.config
    return cfg.selection == "prophet" and 0.0 < cfg.recompute_ratio < 1.0 and sb.total_reused > 0


class QueryScorePlan(RowPlan):
    """Keeps every row; at every layer adds the query rows' attention mass to each blended
    sequence's ``query_scores`` (indexed by absolute position)."""

    def __init__(self, attn_metadata, blends: list[SeqBlend], attn_backend) -> None:
        md = attn_metadata
        self.rows = torch.arange(md.num_tokens)
        self.seq_ids = md.row_seq_ids()
        self.blends = blends
        self.backend = attn_backend
        for sb in blends:
            sb.query_scores = torch.zeros(md.seq_lens_cpu[sb.index], dtype=torch.float32)

    def selects_at(self, layer_idx: int) -> bool:
        return True

    def select(self, layer_idx, attn, q, k, v, kv_cache, attn_metadata):
        md = attn_metadata
        for sb in self.blends:
            rows = torch.nonzero(self.seq_ids == sb.index).flatten().to(md.positions.device)
            positions = md.positions[rows]
            is_query = positions >= sb.query_start
            if not is_query.any():
                continue
            seq_len = md.seq_lens_cpu[sb.index]
            key_positions = torch.arange(seq_len, device=positions.device)
            table = md.block_table[sb.index].long()
            bs = md.block_size
            slots = table[key_positions // bs] * bs + key_positions % bs
            keys, _ = self.backend.read_kv(kv_cache, slots)  # reused K; these rows' are stale
            qr, kr = attn.rotary_emb.apply_rotary(positions, q[rows], k[rows])
            keys = keys.clone()
            keys[positions] = kr.to(keys.dtype)
            sb.query_scores += query_attention_mass(
                qr[is_query], keys, positions[is_query], key_positions
            ).cpu()
        return None


def run_query_pass(
    model, input_ids, attn_metadata, kv_caches, blends, attn_backend, hooks=None
) -> None:
    """The first stage for every ``prophet`` sequence of the step (no-op without one).
    ``hooks``: the connector, so each layer waits for its loaded K/V (pipelined loading)."""
    prophets = [sb for sb in blends if needs_query_pass(sb)]
    if not prophets:
        return
    md = attn_metadata
    starts = md.query_start_loc_cpu
    keep = torch.zeros(md.num_tokens, dtype=torch.bool)
    for sb in prophets:
        keep[starts[sb.index] : starts[sb.index + 1]] = ~sb.reused
    sub = md.subset(keep)
    plan = QueryScorePlan(sub, prophets, attn_backend)
    ids = input_ids[keep.to(input_ids.device)]
    model(ids, sub.positions, kv_caches, sub, row_plan=plan, hooks=hooks, kv_only=True)
    num_layers = len(kv_caches)
    for sb in prophets:
        sb.extra_row_layers = float(int((~sb.reused).sum()) * num_layers)
