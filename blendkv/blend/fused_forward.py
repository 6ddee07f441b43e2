"""The fused prefill: the model run layer by layer over a shrinking set of rows.

A step's rows are the flattened tokens of all scheduled sequences (plain prefills, decodes and
blended prefills). Plain rows run every layer. For a blended sequence, at each of its selection
layers the fresh Q/K/V of its rows are computed once, its reused rows are scored against the
reused K/V already in its blocks, and the rows not picked leave the set: from then on their
K/V stays the reused one. Rows that remain write fresh K/V and attend over the whole fused K/V
with the exact per-row causal mask of the attention backend (a row at position p sees keys at
positions <= p, whatever rows are around it).

    layer:        0 .. check-1      check            check+1 .. last
    blended seq:  every row         fresh QKV, pick  picked reused + non-reused rows only
    plain seq:    every row         every row        every row
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blendkv.blend.config import BlendConfig
from blendkv.blend.layer_ops import finish_layer, input_norm
from blendkv.blend.selection import SelectionInputs, score_rows, top_rows
from blendkv.kernels.attention import AttentionMetadata


@dataclass
class SeqBlend:
    """A blended sequence in this step. ``reused`` flags its rows (in step order)."""

    index: int  # position of the sequence in the step's batch
    reused: torch.Tensor  # bool [num rows of this seq in the step]
    config: BlendConfig
    query_start: int  # absolute position of the first token after the last chunk
    total_reused: int
    generator: torch.Generator


def subset_metadata(md: AttentionMetadata, keep: torch.Tensor, seq_ids: torch.Tensor):
    """Metadata for the rows in ``keep`` (bool over the current rows; order preserved)."""
    counts = torch.bincount(seq_ids[keep], minlength=md.num_seqs).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    old_counts = [
        b - a for a, b in zip(md.query_start_loc_cpu, md.query_start_loc_cpu[1:], strict=False)
    ]
    contiguous = [
        c and md.is_contiguous_prefill[i] and c == old_counts[i] for i, c in enumerate(counts)
    ]
    return AttentionMetadata(
        positions=md.positions[keep],
        slot_mapping=md.slot_mapping[keep],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=md.positions.device),
        seq_lens=md.seq_lens,
        block_table=md.block_table,
        block_size=md.block_size,
        max_query_len=max(counts),
        max_seq_len=md.max_seq_len,
        query_start_loc_cpu=starts,
        seq_lens_cpu=md.seq_lens_cpu,
        is_contiguous_prefill=[bool(c) for c in contiguous],
    )


@torch.inference_mode()
def fused_forward(model, input_ids, md: AttentionMetadata, kv_caches, blends: list[SeqBlend]):
    """Run the step; returns (final hidden of the kept rows, kept row indices into the step)."""
    inner = model.model
    n = input_ids.shape[0]
    starts = md.query_start_loc_cpu
    seq_ids = torch.repeat_interleave(
        torch.arange(md.num_seqs),
        torch.tensor([b - a for a, b in zip(starts, starts[1:], strict=False)]),
    )
    reused = torch.zeros(n, dtype=torch.bool)
    for sb in blends:
        reused[starts[sb.index] : starts[sb.index + 1]] = sb.reused
    rows = torch.arange(n)
    schedules = [sb.config.selection_layers() for sb in blends]
    hidden, residual = inner.embed_tokens(input_ids), None
    for layer_idx, layer in enumerate(inner.layers):
        kv_cache = kv_caches[layer_idx]
        selecting = [
            (sb, s[layer_idx]) for sb, s in zip(blends, schedules, strict=True) if layer_idx in s
        ]
        if not selecting:
            hidden, residual = layer(md.positions, hidden, residual, kv_cache, md)
            continue
        normed, residual = input_norm(layer, hidden, residual)
        q, k, v = layer.self_attn.project(normed)
        keep = torch.ones(len(rows), dtype=torch.bool)
        for sb, ratio in selecting:
            _select(layer.self_attn, sb, ratio, md, seq_ids, reused, q, k, v, kv_cache, keep)
        if not keep.all():
            md = subset_metadata(md, keep, seq_ids)
            rows, seq_ids, reused = rows[keep], seq_ids[keep], reused[keep]
            normed, residual, q, k, v = (t[keep] for t in (normed, residual, q, k, v))
        attn = layer.self_attn.attend(md.positions, q, k, v, kv_cache, md)
        hidden, residual = finish_layer(layer, attn, residual)
    hidden, _ = inner.norm(hidden, residual)
    return hidden, rows


def _select(attn, sb: SeqBlend, ratio, md, seq_ids, reused, q, k, v, kv_cache, keep) -> None:
    """Drop from ``keep`` the reused rows of ``sb`` that are not among the top ``ratio``."""
    seq_rows = torch.nonzero(seq_ids == sb.index).flatten()
    cand = seq_rows[reused[seq_rows]]
    count = int(round(ratio * sb.total_reused))
    if len(cand) == 0 or count >= len(cand):
        return
    positions = md.positions
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    slots = md.slot_mapping[cand]
    strategy = sb.config.selection
    inputs = SelectionInputs(
        cand=cand,
        fresh_k=attn.rotary_emb.rotate_k(positions[cand], k[cand])
        if strategy != "v_deviation"
        else k[cand],
        fresh_v=v[cand],
        cached_k=flat[0, slots],
        cached_v=flat[1, slots],
    )
    if strategy == "attention":
        query_rows = seq_rows[positions[seq_rows] >= sb.query_start]
        qr, kr = attn.rotary_emb.apply_rotary(positions[seq_rows], q[seq_rows], k[seq_rows])
        in_seq = torch.searchsorted(seq_rows, cand)
        inputs.query_q = qr[torch.searchsorted(seq_rows, query_rows)]
        inputs.seq_k = kr
        inputs.seq_k_positions = positions[seq_rows]
        inputs.query_positions = positions[query_rows]
        inputs.cand_in_seq = in_seq
    chosen = top_rows(score_rows(strategy, inputs, sb.generator), count)
    keep[cand] = False
    keep[cand[chosen]] = True
