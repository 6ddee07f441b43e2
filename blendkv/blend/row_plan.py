"""The fused prefill's row plan: which rows each layer computes when a step blends.

Plain rows (prefills, decodes) run every layer. At each selection layer of a blended sequence
its rows' fresh Q/K/V are scored against the reused K/V in its blocks, and reused rows not
picked leave the set: their K/V stays the reused one (or is shifted: ``correction``). Remaining
rows attend with the backend's exact per-row causal mask. Bookkeeping lives in CPU tensors;
the picks come back to the host once per selection layer (the loop's only device sync).

    layer:        0 .. check-1      check            check+1 .. last
    blended seq:  every row         fresh QKV, pick  picked reused + non-reused rows only
    plain seq:    every row         every row        every row

``prophet`` picks at layer 0 (:mod:`blendkv.blend.prophet`); ``reselect``/``schedule`` again
deeper. The layer loop is the model's (:mod:`blendkv.models.hooks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blendkv.blend.config import BlendConfig
from blendkv.blend.correction import Rows, correct_kept_rows, shift_parts
from blendkv.blend.selection import SelectionInputs, score_rows, top_rows
from blendkv.blend.stats import BlendStats
from blendkv.blend.token_map import TokenTrace
from blendkv.kernels.uploads import upload
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
    # Per row of this seq in the step: index of its chunk in the prompt and offset in it
    # (-1 for rows without reused K/V).
    chunk_ids: torch.Tensor | None = None
    chunk_offsets: torch.Tensor | None = None
    num_chunks: int = 0
    # Per row: its stored K/V is already full prefill's (a chunk stored behind exactly the
    # prompt's tokens before it, losslessly); ``config.skip_exact`` never picks these.
    exact: torch.Tensor | None = None
    # prophet: attention mass the query rows paid each position (indexed by absolute position)
    query_scores: torch.Tensor | None = None
    extra_row_layers: float = 0.0  # row-layers run for this seq before the fused forward
    extra_key_row_layers: int = 0  # and the (row, key) pairs x layers they attended to
    # The request asked for its token map: what happens to each row is recorded here.
    trace: TokenTrace | None = None
    # (layer, rows in, rows kept, whether the dropped ones ran the Q/K/V projections)
    _events: list[tuple[int, int, int, bool]] = field(default_factory=list)


# Selection scores that need no fresh q/k/v of the layer they pick at.
_SCORES_WITHOUT_QKV = ("prophet", "random", "heads")


class BlendRowPlan(RowPlan):
    def __init__(
        self,
        attn_metadata,
        blends: list[SeqBlend],
        attn_backend,
        blend_kernels,
        num_layers: int,
        qkv_share: float = 0.0,
    ) -> None:
        """``blend_kernels``: the blend's kernels on ``attn_backend``'s pool (the K/V
        correction's). ``qkv_share``: the Q/K/V projections' share of a layer's cost; rows
        dropped at a selection layer ran only those (for the stats' ``compute_fraction``)."""
        md = attn_metadata
        n = md.num_tokens
        starts = md.query_start_loc_cpu
        assert not any(sb.config.auto_ratio for sb in blends), "the loader resolves 'auto'"
        self.blends = blends
        self.backend = attn_backend
        self.kernels = blend_kernels
        self.num_layers = num_layers
        self.qkv_share = qkv_share
        self.rows = torch.arange(n)
        self.seq_ids = md.row_seq_ids()
        self.positions = md.host_positions()  # the host's copy: no device read
        self.reused = torch.zeros(n, dtype=torch.bool)
        for sb in blends:
            self.reused[starts[sb.index] : starts[sb.index + 1]] = sb.reused
        self.starts = starts
        self.all_positions = md.positions
        self.all_slots = md.slot_mapping
        self.schedules = [sb.config.selection_layers(num_layers) for sb in blends]
        self._row_counts = [(0, n)]  # (from layer, rows computed) as the set shrinks
        # (from layer, keys the computed rows attend to: position + 1 each), for profiling
        self._key_counts = [(0, int(self.positions.sum()) + n)]
        self.layers = set().union(*self.schedules)
        self._exact: dict[int, torch.Tensor] = {}  # seq index -> rows made exact this layer
        # seq index -> its correction's rows, kept while the row set stays (until a selection)
        self._correction_rows: dict[int, tuple] = {}
        # seq index -> its rows the query pass computed exactly (left out of this forward)
        self._settled: dict[int, int] = {}
        for sb in blends:
            sb._events = []
        self._record()

    def selects_at(self, layer_idx: int) -> bool:
        return layer_idx in self.layers

    def selects_before_projection(self, layer_idx: int) -> bool:
        """Every sequence picking here scores without this layer's q/k/v (ProphetKV's query
        pass, random, chunk heads) and writes nothing for the rows it drops (no correction
        past layer 0): at ProphetKV's layer 0 the ~90 % of rows dropped skip norm and QKV."""
        for sb, schedule in zip(self.blends, self.schedules, strict=True):
            if layer_idx not in schedule:
                continue
            if sb.config.score_at(layer_idx) not in _SCORES_WITHOUT_QKV:
                return False
            if sb.config.correction != "none" and layer_idx > 0:
                return False
        return True

    def select(self, layer_idx, attn, q, k, v, kv_cache, attn_metadata):
        keep = torch.ones(len(self.rows), dtype=torch.bool)
        self._exact = {}
        self._correction_rows = {}
        for sb, schedule in zip(self.blends, self.schedules, strict=True):
            if layer_idx in schedule:
                before = int(keep.sum())
                if sb.query_scores is not None and layer_idx == min(schedule):
                    settled = self._settled_by_query_pass(sb)
                    self._settled[sb.index] = int(settled.sum())
                    keep[settled] = False
                self._select(
                    attn, sb, layer_idx, schedule[layer_idx], attn_metadata, q, k, v, kv_cache, keep
                )
                n_in = int((self.seq_ids == sb.index).sum())
                kept = n_in - (before - int(keep.sum()))
                sb._events.append((layer_idx, n_in, kept, q is not None))
        if not keep.all():
            self._trace_dropped(layer_idx, keep)
            self.rows, self.seq_ids, self.reused, self.positions = (
                t[keep] for t in (self.rows, self.seq_ids, self.reused, self.positions)
            )
            self._row_counts.append((layer_idx, len(self.rows)))
            self._key_counts.append((layer_idx, int(self.positions.sum()) + len(self.rows)))
        self._record()
        return None if keep.all() else keep

    def _trace_dropped(self, layer_idx: int, keep: torch.Tensor) -> None:
        """Traced sequences: their rows leaving the set at this layer."""
        for sb in self.blends:
            if sb.trace is not None:
                gone = ~keep & (self.seq_ids == sb.index)
                sb.trace.record_dropped(layer_idx, self.rows[gone] - self.starts[sb.index])

    def _settled_by_query_pass(self, sb: SeqBlend) -> torch.Tensor:
        """Rows (of the current set) that ProphetKV's query pass already computed exactly:
        ``sb``'s rows before its first reused one (a system prompt, the template's head). They
        see no reused K/V, and the pass wrote their K/V at every layer, so the fused forward
        skips them. Rows between or after chunks saw reused K/V there: they stay."""
        mine = self.seq_ids == sb.index
        reused = mine & self.reused
        if not reused.any():
            return torch.zeros_like(mine)
        return mine & ~self.reused & (self.positions < self.positions[reused].min())

    def _select(self, attn, sb: SeqBlend, layer_idx, ratio, md, q, k, v, kv_cache, keep) -> None:
        """Drop from ``keep`` the reused rows of ``sb`` that are not among the top ``ratio``."""
        seq_rows = torch.nonzero(self.seq_ids == sb.index).flatten()
        cand = seq_rows[self.reused[seq_rows]]
        count = int(round(ratio * sb.total_reused))
        if sb.config.skip_exact and sb.exact is not None and count < len(cand):
            exact = sb.exact[self.rows[cand] - self.starts[sb.index]]
            keep[cand[exact]] = False  # as stored is as computed: never worth a recompute
            cand = cand[~exact]
        if len(cand) == 0 or count >= len(cand):
            return
        if count == 0:  # full reuse: no scores needed
            keep[cand] = False
            return
        cand_d = upload(cand, md.positions.device)
        local = self.rows[cand] - self.starts[sb.index]  # candidates' rows within the seq
        strategy = sb.config.score_at(layer_idx)
        inputs = self._kv_inputs(attn, strategy, md, cand, cand_d, k, v, kv_cache)
        if strategy == "attention":
            self._add_attention_inputs(inputs, attn, sb, seq_rows, cand, md.positions, q, k)
        elif strategy == "heads":
            inputs.chunk_offsets = sb.chunk_offsets[local]
        elif strategy == "prophet":
            inputs.query_scores = sb.query_scores[self.positions[cand]]
        forced = _forced_rows(sb, local)
        scores = score_rows(strategy, inputs, sb.generator)
        chosen = top_rows(scores, count, forced).cpu()
        if sb.trace is not None:
            sb.trace.record_scores(layer_idx, strategy, local, scores, forced)
        keep[cand] = False
        keep[cand[chosen]] = True
        if sb.config.correction != "none" and layer_idx > 0:
            self._write_dropped(attn, sb, cand[~keep[cand]], md, k, v, kv_cache)

    def _kv_inputs(self, attn, strategy: str, md, cand, cand_d, k, v, kv_cache) -> SelectionInputs:
        """The candidates' K/V to score: the reused one from the pool (for the strategies that
        compare with it) and the fresh one (none when selecting before the projections)."""
        cached_k = cached_v = None
        if strategy in ("v_deviation", "k_deviation", "attention"):
            cached_k, cached_v = self.backend.read_kv(kv_cache, md.slot_mapping[cand_d])
        fresh_k = fresh_v = None  # (no q/k/v when selecting before the projections)
        if k is not None:
            fresh_k = k[cand_d]
            if strategy == "k_deviation":
                fresh_k = attn.rotary_emb.rotate_k(md.positions[cand_d], fresh_k)
            fresh_v = v[cand_d]
        return SelectionInputs(
            cand=cand,
            fresh_k=fresh_k,
            fresh_v=fresh_v,
            cached_k=cached_k,
            cached_v=cached_v,
        )

    def _add_attention_inputs(
        self, inputs: SelectionInputs, attn, sb: SeqBlend, seq_rows, cand, positions, q, k
    ) -> None:
        """The ``attention`` strategy's inputs: the fresh queries of ``sb``'s query rows and
        the fresh keys of all its current rows (RoPE applied), their positions, and each
        candidate's index among those keys."""
        device = positions.device
        query_rows = seq_rows[self.positions[seq_rows] >= sb.query_start]
        seq_d = seq_rows.to(device)
        qr, kr = attn.rotary_emb.apply_rotary(positions[seq_d], q[seq_d], k[seq_d])
        inputs.query_q = qr[torch.searchsorted(seq_rows, query_rows).to(device)]
        inputs.seq_k = kr
        inputs.seq_k_positions = positions[seq_d]
        inputs.query_positions = positions[query_rows.to(device)]
        inputs.cand_in_seq = torch.searchsorted(seq_rows, cand).to(device)

    def _write_dropped(self, attn, sb: SeqBlend, dropped, md, k, v, kv_cache) -> None:
        """The correction's selection past layer 0: the ``dropped`` rows' fresh K/V here is
        exact (at layer 0 the reused one already is), so it goes into the pool; the rows are
        remembered as ``sb``'s exact ones of this layer."""
        dropped_d = dropped.to(md.positions.device)
        k_rot = attn.rotary_emb.rotate_k(md.positions[dropped_d], k[dropped_d])
        self.backend.write_kv(kv_cache, k_rot, v[dropped_d], md.slot_mapping[dropped_d])
        self._exact[sb.index] = self.rows[dropped]

    def before_attention(self, layer_idx, attn, q, k, v, kv_cache, attn_metadata) -> None:
        for sb, schedule in zip(self.blends, self.schedules, strict=True):
            if sb.config.correction != "none" and layer_idx > min(schedule):
                self._correct(attn, sb, k, v, kv_cache, attn_metadata)
        self._exact = {}

    def _correct(self, attn, sb: SeqBlend, k, v, kv_cache, md) -> None:
        """Shift the kept rows of ``sb`` by its recomputed rows' mean deviation per chunk."""
        exact = self._exact.get(sb.index)
        rows = self._correction_rows.get(sb.index) if exact is None else None
        if rows is None:
            rows = self._correction_split(sb, exact, md, k.device)
            if exact is None:  # the same rows every layer until the next selection
                self._correction_rows[sb.index] = rows
        recomputed, kept = rows
        correct_kept_rows(
            self.kernels,
            attn.rotary_emb,
            kv_cache,
            sb.config.correction,
            float(sb.config.correction_shrink),
            sb.config.correction_prior == "pooled",
            recomputed,
            k,
            v,
            kept,
            sb.num_chunks,
        )

    def _correction_split(self, sb: SeqBlend, exact, md, dev) -> tuple[Rows, Rows]:
        """``sb``'s reused rows computed this layer and its kept ones (those not computed, nor
        made exact at this layer)."""
        lo = self.starts[sb.index]
        mine = self.seq_ids == sb.index
        rec = torch.nonzero(mine & self.reused).flatten()  # current rows, reused
        computed = torch.zeros(len(sb.reused), dtype=torch.bool)
        computed[self.rows[mine] - lo] = True
        if exact is not None:
            computed[exact - lo] = True
        if sb.config.skip_exact and sb.exact is not None:
            computed |= sb.exact  # stored as computed: nothing to shift
        kept = torch.nonzero(sb.reused & ~computed).flatten() + lo  # step rows
        rec_local = self.rows[rec] - lo
        rec_d, kept_d = upload(rec, dev), upload(kept, dev)
        rec_chunks, kept_chunks = sb.chunk_ids[rec_local], sb.chunk_ids[kept - lo]
        if sb.trace is not None:
            _trace_corrected(sb, rec_chunks, kept - lo, kept_chunks)
        segments = kept_segments = None
        parts = 1
        if self.kernels.fused_chunk_shift and _ascending(rec_chunks) and _ascending(kept_chunks):
            segments = _segments(rec_chunks, sb.num_chunks)
            kept_segments = _segments(kept_chunks, sb.num_chunks)
            parts = shift_parts(kept_segments.tolist())
            segments, kept_segments = upload(segments, dev), upload(kept_segments, dev)
        recomputed = Rows(
            md.positions[rec_d], md.slot_mapping[rec_d], upload(rec_chunks, dev), rec_d, segments
        )
        kept_rows = Rows(
            self.all_positions[kept_d],
            self.all_slots[kept_d],
            upload(kept_chunks, dev),
            None,
            kept_segments,
            parts,
        )
        return recomputed, kept_rows

    def row_layers(self, num_layers: int) -> int:
        """Rows x layers this forward computed (so far), ProphetKV's query pass before it
        included: the work the controller times."""
        extra = sum(int(sb.extra_row_layers) for sb in self.blends)
        return _layers_sum(self._row_counts, num_layers) + extra

    def key_row_layers(self, num_layers: int) -> int:
        """(Query row, key) pairs x layers of causal attention this forward computed (so far),
        the query pass included: a row at position p attends to p + 1 keys, so late rows cost
        more than early ones."""
        extra = sum(sb.extra_key_row_layers for sb in self.blends)
        return _layers_sum(self._key_counts, num_layers) + extra

    def _record(self) -> None:
        """Rows computed through the last layer so far, per blended sequence (final after the
        last selection layer: rows only ever leave the set there; those the query pass settled
        count), and the row-layers run."""
        for sb in self.blends:
            lo, hi = self.starts[sb.index], self.starts[sb.index + 1]
            mine = self.rows[(self.rows >= lo) & (self.rows < hi)] - lo
            sb.stats.tokens_recomputed = len(mine) + self._settled.get(sb.index, 0)
            sb.stats.reused_tokens_recomputed = int(sb.reused[mine].sum())
            cost, prev, count = sb.extra_row_layers, 0, hi - lo
            for layer, n_in, n_out, projected in sb._events:
                dropped = (n_in - n_out) * self.qkv_share if projected else 0.0
                cost += count * (layer - prev) + n_out + dropped
                prev, count = layer + 1, n_out
            cost += count * (self.num_layers - prev)
            sb.stats.row_layers = cost
            sb.stats.full_row_layers = (hi - lo) * self.num_layers


def _trace_corrected(sb: SeqBlend, rec_chunks, kept_local, kept_chunks) -> None:
    """The kept rows the correction moves: those of chunks with recomputed rows (a chunk
    without any moves by the prior only: ``pooled``, when the sequence has recomputed rows)."""
    if len(rec_chunks) == 0 or len(kept_local) == 0:
        return
    if sb.config.correction_prior == "pooled" and sb.config.correction_shrink > 0:
        sb.trace.record_corrected(kept_local)
        return
    has_rows = torch.bincount(rec_chunks, minlength=sb.num_chunks) > 0
    sb.trace.record_corrected(kept_local[has_rows[kept_chunks]])


def _ascending(chunk_ids: torch.Tensor) -> bool:
    return bool((chunk_ids[1:] >= chunk_ids[:-1]).all())


def _segments(chunk_ids: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Ascending CPU chunk ids -> int32 [chunks + 1]: chunk c's rows are ``[c] .. [c + 1]``."""
    counts = torch.bincount(chunk_ids, minlength=num_chunks)
    return torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32)


def _forced_rows(sb: SeqBlend, local: torch.Tensor) -> torch.Tensor | None:
    """bool [len(local)]: which of ``sb``'s candidate rows ``local`` are always recomputed
    (a chunk's first ``chunk_head_tokens``, its ``chunk_samples`` spread rows), or None."""
    forced = None
    if sb.config.chunk_head_tokens:
        forced = sb.chunk_offsets[local] < sb.config.chunk_head_tokens
    if sb.config.chunk_samples:
        sampled = _spread_rows(sb, local, sb.config.chunk_samples)
        forced = sampled if forced is None else forced | sampled
    return forced


def _spread_rows(sb: SeqBlend, local: torch.Tensor, n: int) -> torch.Tensor:
    """bool [len(local)]: which of ``sb``'s rows ``local`` are among ``n`` rows spread evenly
    over their chunk (offsets ``floor((i + 1/2) * length / n)``, ``i < n``)."""
    chunks, offsets = sb.chunk_ids[local], sb.chunk_offsets[local]
    mine = sb.chunk_ids >= 0
    lengths = torch.zeros(sb.num_chunks, dtype=torch.long)
    lengths.scatter_reduce_(0, sb.chunk_ids[mine], sb.chunk_offsets[mine] + 1, "amax")
    length = lengths[chunks]
    # row o is a sample iff some i has floor((i + 1/2) L / n) == o, i.e. the first
    # i >= o n / L - 1/2 lands on o
    i = torch.ceil((offsets * n).double() / length - 0.5).clamp_min(0)
    hit = torch.floor((i + 0.5) * length / n).long() == offsets
    return hit & (i < n)


def _layers_sum(counts: list[tuple[int, int]], num_layers: int) -> int:
    """Sum over layers of a count that changes at the layers given: [(from layer, count)]."""
    bounds = [layer for layer, _ in counts[1:]] + [num_layers]
    return sum(c * (end - start) for (start, c), end in zip(counts, bounds, strict=True))
