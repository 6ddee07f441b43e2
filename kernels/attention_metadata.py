"""Per-step attention metadata shared by every layer, and the helpers that read it.

Built by :meth:`~blendkv.kernels.attention.AttentionBackend.build_metadata`; the layout of a
step (flattened tokens, ``query_start_loc``, ``seq_lens``, positions) and the masking rule are
in :mod:`blendkv.kernels.attention`'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from blendkv.kernels.uploads import upload, upload_list


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer. Built by :meth:`AttentionBackend.build_metadata`.

    Attributes:
        positions: [num_tokens] int64, absolute position of each query token.
        slot_mapping: [num_tokens] int64, KV-cache slot (``block_id * block_size + offset``)
            that each query token's K/V is written to (every entry valid).
        query_start_loc: [num_seqs + 1] int32 (cumulative query lengths).
        seq_lens: [num_seqs] int32, number of keys each sequence attends over after this step.
        block_table: [num_seqs, max_blocks] int32, physical block ids (padded with 0).
        block_size: tokens per KV block.
        max_query_len / max_seq_len: Python ints, for shape decisions without a device sync.
        query_start_loc_cpu / seq_lens_cpu: Python lists mirroring the tensors (cheap loops).
        is_contiguous_prefill: per sequence, True when its query tokens are exactly positions
            ``seq_len - query_len .. seq_len - 1`` in order (ordinary prefill/decode).
        positions_cpu: ``positions`` on the CPU, the copy the metadata was built from (None
            where it was not kept): :meth:`host_positions` reads it without a host sync.

    Dense metadata (:meth:`AttentionBackend.dense_metadata`, no KV pool) has empty
    ``slot_mapping`` and ``block_table``: every sequence is a fresh prefill at 0..n-1.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    is_contiguous_prefill: list[bool]
    positions_cpu: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    def host_positions(self) -> torch.Tensor:
        """``positions`` on the CPU: the host copy when kept (no sync), else read back."""
        if self.positions_cpu is not None:
            return self.positions_cpu
        return self.positions.cpu()

    def row_seq_ids(self) -> torch.Tensor:
        """[num_tokens] int64: the index (in the step) of the sequence each row belongs to."""
        starts = self.query_start_loc_cpu
        counts = torch.tensor([b - a for a, b in zip(starts, starts[1:], strict=False)])
        return torch.repeat_interleave(torch.arange(self.num_seqs), counts)

    def subset(self, keep: torch.Tensor, seq_ids: torch.Tensor | None = None) -> AttentionMetadata:
        """Metadata for the rows in ``keep`` (bool over the current rows; order preserved).

        ``keep`` is a CPU tensor (the row plan's bookkeeping); ``seq_ids`` is
        :meth:`row_seq_ids` of the current rows (computed when None). A sequence keeps its keys
        (``seq_lens``, ``block_table``): rows that leave stop being computed, not being seen.
        """
        if seq_ids is None:
            seq_ids = self.row_seq_ids()
        counts = torch.bincount(seq_ids[keep.cpu()], minlength=self.num_seqs).tolist()
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        old = self.query_start_loc_cpu
        contiguous = [
            bool(c) and self.is_contiguous_prefill[i] and c == old[i + 1] - old[i]
            for i, c in enumerate(counts)
        ]
        keep = keep.cpu()
        rows = kept_rows(keep, self.positions.device)
        return AttentionMetadata(
            positions=self.positions[rows],
            slot_mapping=self.slot_mapping[rows],
            query_start_loc=upload_list(starts, torch.int32, self.positions.device),
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            block_size=self.block_size,
            max_query_len=max(counts),
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=starts,
            seq_lens_cpu=self.seq_lens_cpu,
            is_contiguous_prefill=contiguous,
            positions_cpu=None if self.positions_cpu is None else self.positions_cpu[keep],
        )


def kept_rows(keep: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The indices of a CPU bool mask's True rows, on ``device``, for gathering device rows:
    indexing a device tensor with a device bool mask syncs the host (the result's size is read
    back), a gather by index does not. Same rows, same order."""
    assert keep.device.type == "cpu", "a device mask would be read back to find its rows"
    return upload(torch.nonzero(keep).flatten(), device)


def split_by_kind(md: AttentionMetadata) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """The step's sequences by how they are attended: ``(fresh, decode, other)``.

    ``fresh``: ``[lo, hi)`` row ranges whose rows are the whole context in order (plain causal
    prefill); ``decode``: sequences with one row, the last position; ``other``: sequences whose
    rows sit at arbitrary positions over cached keys (chunked prefill, prefix hits, CacheBlend's
    scattered rows). Sequences without rows in this pass are in none.
    """
    starts = md.query_start_loc_cpu
    fresh, decode, other = [], [], []
    for i in range(md.num_seqs):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        if md.is_contiguous_prefill[i] and hi - lo == 1:
            decode.append(i)
        elif md.is_contiguous_prefill[i] and hi - lo == md.seq_lens_cpu[i]:
            fresh.append((lo, hi))
        else:
            other.append(i)
    return fresh, decode, other


class StepLayoutMemo:
    """What a backend derives from one metadata object, built by its first layer and reused by
    the other layers of the step.

    Entries are matched by identity (a step's layers share one metadata object, or a few when
    CacheBlend narrows the rows layer by layer); holding the object keeps its ``id`` from being
    reused while it is remembered.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: list[tuple[AttentionMetadata, Any, Any]] = []

    def get(self, md: AttentionMetadata, key: Any, build: Callable[[], Any]) -> Any:
        for seen, seen_key, layout in self._entries:
            if seen is md and seen_key == key:
                return layout
        layout = build()
        self._entries = [*self._entries[-(self.size - 1) :], (md, key, layout)]
        return layout

    def layouts_for(self, md: AttentionMetadata) -> list[Any]:
        return [layout for seen, _, layout in self._entries if seen is md]
