"""ProphetKV's first stage (arXiv 2602.02579): which chunk tokens does the query need?

Before the fused forward, a pass of only the rows without reused K/V (template, query) runs
through every layer over the reused K/V already loaded into the blocks: a few dozen rows, so
cheap. At each layer the attention the query rows (positions from ``query_start`` on) pay each
position is summed over heads and rows, and over layers. The fused forward then recomputes the
top-scored reused rows from layer 0 (``selection="prophet"``, :class:`BlendRowPlan`). The pass
writes the non-reused rows' K/V at every layer; the fused forward computes and overwrites them.
The model runner runs the pass (:func:`plan_query_pass` says what to run) through the model's one
layer loop with :class:`QueryPassRowPlan` as its row plan, or replays it from a captured graph.
"""

from __future__ import annotations

import torch

from blendkv.blend.row_plan import SeqBlend
from blendkv.kernels.attention import QueryMassRequest, QueryScoring, kept_rows
from blendkv.models.hooks import QueryPass, QueryPassPlan, QueryPassReplay


def needs_query_pass(sb: SeqBlend) -> bool:
    cfg = sb.config
    return cfg.selection == "prophet" and 0.0 < cfg.recompute_ratio < 1.0 and sb.total_reused > 0


class QueryPassRowPlan(QueryPassPlan):
    """Keeps every row; at every layer adds the query rows' attention mass to each blended
    sequence's ``query_scores`` (indexed by absolute position).

    Everything that is the same at every layer (each sequence's rows, query rows, key slots) is
    built once here, and the scores add up on the device: a layer costs no host sync (on a GPU
    one per layer left it idle most of the pass). :meth:`finish` brings the scores to the CPU.

    A backend scoring ``"in_attention"`` (the torch one) scores inside its attention: the
    plan's :meth:`scoring` holds a :class:`QueryMassRequest` per sequence and the plan selects
    nothing, so q and K are multiplied once per layer, not twice. Otherwise each layer is scored
    through ``add_query_mass`` (the Triton kernels) reading the pool in place: after attention
    wrote the rows' K/V (:meth:`after_attention`, with attention's RoPE'd queries and, from a
    backend scoring ``"from_lse"``, the log-sum-exp it left in the scoring's ``lse_out``), and
    at ``last_layer``, where the pass stops after the projections, by :meth:`select`, which
    rotates and writes them itself.
    """

    def __init__(
        self, attn_metadata, blends: list[SeqBlend], attn_backend, last_layer: int | None = None
    ) -> None:
        self.md = attn_metadata
        self.last_layer = last_layer
        self.rows = torch.arange(attn_metadata.num_tokens)
        self.backend = attn_backend
        self.blends = blends
        self.in_attention = attn_backend.query_scoring == "in_attention"
        self._seqs = []
        self._scoring = QueryScoring()

    def scoring(self) -> QueryScoring | None:
        return self._scoring if self._scoring else None

    def begin(self) -> None:
        md, blends = self.md, self.blends
        dev = md.positions.device
        requests = self._scoring.requests
        # (seq blend, its rows, their positions and slots, query rows, their positions, key
        # slots, keys every query row sees)
        self._seqs = []
        starts = md.query_start_loc_cpu
        positions_cpu = md.host_positions()
        self.positions_cpu = positions_cpu
        for sb in blends:
            seq_len = md.seq_lens_cpu[sb.index]
            sb.query_scores = torch.zeros(seq_len, dtype=torch.float32, device=dev)
            lo, hi = starts[sb.index], starts[sb.index + 1]
            is_query = positions_cpu[lo:hi] >= sb.query_start
            if not is_query.any():
                continue
            # keys 0 .. the first query row's position are seen by every query row: unmasked
            visible = int(positions_cpu[lo:hi][is_query].min()) + 1
            first = hi - int(is_query.sum())
            # rows are laid out in position order, so the query rows are the sequence's last
            assert bool(is_query[first - lo :].all()), "query rows must be the last rows"
            if self.in_attention:
                requests[sb.index] = QueryMassRequest(first, sb.query_scores, visible)
                continue
            key_positions = torch.arange(seq_len, device=dev)
            table = md.block_table[sb.index].long()
            bs = md.block_size
            slots = table[key_positions // bs] * bs + key_positions % bs
            query = slice(first - lo, hi - lo)  # the sequence's last rows: a view, no gather
            positions = md.positions[lo:hi]
            self._seqs.append(
                (
                    sb,
                    slice(lo, hi),
                    positions,
                    md.slot_mapping[lo:hi],
                    query,
                    positions[query],
                    slots,
                    visible,
                )
            )

    def selects_at(self, layer_idx: int) -> bool:
        return bool(self._seqs) and layer_idx == self.last_layer

    def select(self, layer_idx, attn, q, k, v, kv_cache, attn_metadata):
        """The layer without attention: the rows' own K/V into the pool here, so the backend
        reads every key in place."""
        for sb, rows, positions, row_slots, query, query_positions, slots, visible in self._seqs:
            qr, _ = attn.rotary_emb.rotate_and_write(
                positions, q[rows], k[rows], v[rows], kv_cache, row_slots, self.backend.write_kv
            )
            self._score(sb, attn, qr[query], query_positions, kv_cache, slots, visible)
        return None

    def before_attention(self, layer_idx, attn, q, k, v, kv_cache, attn_metadata) -> None:
        # A backend whose attention leaves the rows' log-sum-exp: one buffer for every layer
        # (each layer's scores read it before the next layer's attention writes it).
        scoring = self._scoring
        if self._seqs and self.backend.query_scoring == "from_lse" and scoring.lse_out is None:
            scoring.lse_out = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)

    def after_attention(self, layer_idx, attn, q_rot, kv_cache, attn_metadata) -> None:
        lse = self._scoring.lse_out
        for sb, rows, _, _, query, query_positions, slots, visible in self._seqs:
            row_lse = None if lse is None else lse[rows][query]
            self._score(
                sb, attn, q_rot[rows][query], query_positions, kv_cache, slots, visible, row_lse
            )

    def _score(self, sb, attn, q_rot, q_positions, kv_cache, slots, visible, lse=None) -> None:
        self.backend.add_query_mass(
            sb.query_scores,
            q_rot,
            q_positions,
            kv_cache,
            slots,
            visible,
            **attn.mass_kwargs(),
            lse=lse,
        )

    def finish(self) -> None:
        for sb in self.blends:
            sb.query_scores = sb.query_scores.cpu()

    def take_replayed(self, scores: torch.Tensor) -> None:
        (sb,) = self.blends  # a replay is one sequence's pass
        sb.query_scores = scores.cpu()


def plan_query_pass(input_ids, attn_metadata, blends, attn_backend, num_layers: int):
    """The query pass of every ``prophet`` sequence of the step, for the model runner to run
    (None without one): the rows without reused K/V of those sequences, their metadata and
    :class:`QueryPassRowPlan`. Counts the pass's work on each sequence (``extra_row_layers``,
    ``extra_key_row_layers``: its rows at every layer, each attending to its position + 1
    keys), beside the fused forward's, for the stats, the profile floors and the controller."""
    prophets = [sb for sb in blends if needs_query_pass(sb)]
    if not prophets:
        return None
    md = attn_metadata
    starts = md.query_start_loc_cpu
    keep = torch.zeros(md.num_tokens, dtype=torch.bool)
    for sb in prophets:
        keep[starts[sb.index] : starts[sb.index + 1]] = ~sb.reused
    sub = md.subset(keep)
    ids = input_ids[kept_rows(keep, input_ids.device)]
    positions_cpu = sub.positions_cpu = sub.host_positions()  # (read back once at most)
    # Scoring in attention needs the last layer's attention too (its MLP is wasted: ~1/30th of
    # the pass); scoring in kernels can stop after the last layer's projections.
    kv_only = attn_backend.query_scoring != "in_attention"
    plan = QueryPassRowPlan(sub, prophets, attn_backend, num_layers - 1 if kv_only else None)
    for sb in prophets:
        lo, hi = sub.query_start_loc_cpu[sb.index], sub.query_start_loc_cpu[sb.index + 1]
        keys = int(positions_cpu[lo:hi].sum()) + hi - lo
        sb.extra_row_layers = float((hi - lo) * num_layers)
        sb.extra_key_row_layers = keys * num_layers
    return QueryPass(ids, sub, plan, kv_only, _replay(ids, sub, positions_cpu, prophets))


def _replay(ids, sub, positions_cpu, prophets) -> QueryPassReplay | None:
    """What a captured pass of the step's one ProphetKV sequence replays from; None where it
    cannot (more than one such sequence, or no query row)."""
    if len(prophets) != 1:
        return None
    sb = prophets[0]
    lo, hi = sub.query_start_loc_cpu[sb.index], sub.query_start_loc_cpu[sb.index + 1]
    is_query = positions_cpu[lo:hi] >= sb.query_start
    if not bool(is_query.any()):
        return None
    return QueryPassReplay(
        ids[lo:hi],
        sub.positions[lo:hi],
        sub.slot_mapping[lo:hi],
        hi - lo - int(is_query.sum()),  # the query rows are the sequence's last
        sub.seq_lens[sb.index : sb.index + 1],
        sub.block_table[sb.index],
        sub.seq_lens_cpu[sb.index],
    )
