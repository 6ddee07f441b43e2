"""The fused prefill's row plan: which rows each layer computes when a step blends.

A step's rows are the flattened tokens of all scheduled sequences (plain prefills, decodes and
blended prefills). Plain rows run every layer. For a blended sequence, at each of its selection
layers the fresh Q/K/V of its rows are scored against the reused K/V already in its blocks, and
the reused rows not picked leave the set: from then on their K/V stays the reused one. Rows that
remain write fresh K/V and attend over the whole fused K/V with the exact per-row causal mask of
the attention backend (a row at position p sees keys at positions <= p, whatever rows are
around it). The layer loop itself is the model's (:mod:`blendkv.models.hooks`).

Bookkeeping (which rows are left, whose they are, whether they are reused) lives in CPU tensors;
the scores are computed on the model's device and the chosen indices come back to the host once
per selection layer, the only device sync a blended forward makes inside its layer loop.

    layer:        0 .. check-1      check            check+1 .. last
    blended seq:  every row         fresh QKV, pick  picked reused + non-reused rows only
    plain seq:    every row         every row        every row
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blendkv.blend.config import BlendConfig
from blendkv.blend.plan import BlendStats
from blendkv.blend.selection import SelectionInputs, score_rows, top_rows
from blendkv.models.hooks import RowPlan


@dataclass
class SeqBlend:
    """A blended sequence in this step. ``reused`` flags its rows (in step order)."""

    index: int  # position of the sequence in the step's batch
    reused: torch.Tensor  # bool [num rows of this seq in the step]
    config: BlendConfig
    query_start: int  # absolute position of the first token after the last chunk
    total_reused: int
    generator: torch.Generator
    stats: BlendStats


class BlendRowPlan(RowPlan):
    def __init__(self, attn_metadata, blends: list[SeqBlend], attn_backend) -> None:
        md = attn_metadata
        n = md.num_tokens
        starts = md.query_start_loc_cpu
        assert not any(sb.config.auto_ratio for sb in blends), "the loader resolves 'auto'"
        self.blends = blends
        self.backend = attn_backend
        self.rows = torch.arange(n)
        self.seq_ids = md.row_seq_ids()
        self.positions = md.positions.cpu()  # before the layer loop: one copy per step
        self.reused = torch.zeros(n, dtype=torch.bool)
        for sb in blends:
            self.reused[starts[sb.index] : starts[sb.index + 1]] = sb.reused
        self.starts = starts
        self.schedules = [sb.config.selection_layers() for sb in blends]
        self._row_counts = [(0, n)]  # (from layer, rows computed) as the set shrinks
        self.layers = set().union(*self.schedules)

    def selects_at(self, layer_idx: int) -> bool:
        return layer_idx in self.layers

    def select(self, layer_idx, attn, q, k, v, kv_cache, attn_metadata):
        keep = torch.ones(len(self.rows), dtype=torch.bool)
        for sb, schedule in zip(self.blends, self.schedules, strict=True):
            if layer_idx in schedule:
                self._select(attn, sb, schedule[layer_idx], attn_metadata, q, k, v, kv_cache, keep)
        if not keep.all():
            self.rows, self.seq_ids, self.reused, self.positions = (
                t[keep] for t in (self.rows, self.seq_ids, self.reused, self.positions)
            )
            self._row_counts.append((layer_idx, len(self.rows)))
        self._record()
        return None if keep.all() else keep

    def _select(self, attn, sb: SeqBlend, ratio, md, q, k, v, kv_cache, keep) -> None:
        """Drop from ``keep`` the reused rows of ``sb`` that are not among the top ``ratio``."""
        seq_rows = torch.nonzero(self.seq_ids == sb.index).flatten()
        cand = seq_rows[self.reused[seq_rows]]
        count = int(round(ratio * sb.total_reused))
        if len(cand) == 0 or count >= len(cand):
            return
        device = q.device
        cand_d = cand.to(device)
        positions = md.positions
        cached_k, cached_v = self.backend.read_kv(kv_cache, md.slot_mapping[cand_d])
        strategy = sb.config.selection
        inputs = SelectionInputs(
            cand=cand,
            fresh_k=attn.rotary_emb.rotate_k(positions[cand_d], k[cand_d])
            if strategy != "v_deviation"
            else k[cand_d],
            fresh_v=v[cand_d],
            cached_k=cached_k,
            cached_v=cached_v,
        )
        if strategy == "attention":
            query_rows = seq_rows[self.positions[seq_rows] >= sb.query_start]
            seq_d = seq_rows.to(device)
            qr, kr = attn.rotary_emb.apply_rotary(positions[seq_d], q[seq_d], k[seq_d])
            inputs.query_q = qr[torch.searchsorted(seq_rows, query_rows).to(device)]
            inputs.seq_k = kr
            inputs.seq_k_positions = positions[seq_d]
            inputs.query_positions = positions[query_rows.to(device)]
            inputs.cand_in_seq = torch.searchsorted(seq_rows, cand).to(device)
        chosen = top_rows(score_rows(strategy, inputs, sb.generator), count).cpu()
        keep[cand] = False
        keep[cand[chosen]] = True

    def row_layers(self, num_layers: int) -> int:
        """Rows x layers this forward computed (so far): the work the controller times."""
        bounds = [layer for layer, _ in self._row_counts[1:]] + [num_layers]
        segments = zip(self._row_counts, bounds, strict=True)
        return sum(rows * (end - start) for (start, rows), end in segments)

    def _record(self) -> None:
        """Rows computed through the last layer so far, per blended sequence (final after the
        last selection layer: rows only ever leave the set there)."""
        for sb in self.blends:
            lo, hi = self.starts[sb.index], self.starts[sb.index + 1]
            mine = self.rows[(self.rows >= lo) & (self.rows < hi)] - lo
            sb.stats.tokens_recomputed = len(mine)
            sb.stats.reused_tokens_recomputed = int(sb.reused[mine].sum())
