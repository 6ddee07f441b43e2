"""Batch-invariant attention (``EngineConfig.deterministic``): a row's output never depends on
what else is in the step.

The default paths choose by the step's shape: a fresh prompt goes through one causal SDPA call,
a prompt continuing over cached keys (chunked prefill, a prefix-cache hit) through masked row
kernels, decode rows through a kernel whose padding (torch) or key splits (Triton) follow the
longest row of the step. Each choice rounds differently, so a prompt's answer depends on its
neighbours, on the prefix cache and on the chunking.

In deterministic mode every query row is attended as a decode row of its own: a pseudo-sequence
of one row at its position whose keys are its sequence's keys ``0..position`` (the causal mask
of a prompt row is exactly that). The decode kernels reduce each row over exactly its keys with
a split that depends on the row alone (:data:`FIXED_NUM_SPLITS` on Triton), so the result is
the same whether the row came alone, in a batch, in a chunk, or after a prefix hit. The cost is
prefill through the decode kernel (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from blendkv.kernels.attention import AttentionMetadata

# Triton's decode kernel splits each row's keys in this many ranges in deterministic mode (the
# default derives it from the step's longest row, which makes the split batch-dependent).
FIXED_NUM_SPLITS = 16


def all_decode_rows(md: AttentionMetadata) -> bool:
    """Whether every sequence of ``md`` has exactly its last position as its one row."""
    starts = md.query_start_loc_cpu
    return all(
        starts[i + 1] - starts[i] == 1 and md.is_contiguous_prefill[i] for i in range(md.num_seqs)
    )


def per_row_metadata(md: AttentionMetadata) -> AttentionMetadata:
    """``md`` with each query row its own one-row sequence over its keys ``0..position`` (the
    same block table); ``md`` itself when that is already so (a pure decode step)."""
    if all_decode_rows(md):
        return md
    seq_ids = md.row_seq_ids().to(md.block_table.device)
    positions_cpu = md.host_positions()
    seq_lens_cpu = (positions_cpu + 1).tolist()
    n = len(seq_lens_cpu)
    dev = md.positions.device
    return AttentionMetadata(
        positions=md.positions,
        slot_mapping=md.slot_mapping,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
        seq_lens=(md.positions + 1).to(torch.int32),
        block_table=md.block_table.index_select(0, seq_ids),
        block_size=md.block_size,
        max_query_len=1,
        max_seq_len=max(seq_lens_cpu, default=1),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens_cpu,
        is_contiguous_prefill=[True] * n,
    )


class PerRowMemo:
    """The per-row metadata of the last few metadata objects (a step's layers share one)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[AttentionMetadata, AttentionMetadata]] = []

    def get(self, md: AttentionMetadata) -> AttentionMetadata:
        for seen, rows in self._entries:
            if seen is md:
                return rows
        rows = per_row_metadata(md)
        self._entries = [*self._entries[-(self.size - 1) :], (md, rows)]
        return rows
