"""Attention metadata and the backend interface.

The model calls one function per layer, ``backend.forward(q, k, v, kv_cache, attn_metadata)``;
everything about paging hides behind it. Tokens of all sequences in a step are flattened into
one dimension (no batch dimension), vLLM-style::

    tokens:           | seq 0 (3 new) | seq 1 (1 new) | seq 2 (4 new)  |
    query_start_loc:  0               3               4                8
    seq_lens:         [ 3,              17,             4 ]   (context incl. new tokens)
    positions:        per token, the absolute position of that token in its sequence

Masking rule (the only one): a query token at position ``p`` sees exactly the keys of its own
sequence at positions ``<= p``. Query positions need not be contiguous (CacheBlend recomputes
scattered rows), and keys at positions that are not being computed this step must already be in
the paged cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer. Built by the model runner.

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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention for the step's query tokens."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
        scale: float,
    ) -> torch.Tensor:
        """Attention for one layer.

        Args:
            q: [num_tokens, num_heads, head_dim] (RoPE applied).
            k, v: [num_tokens, num_kv_heads, head_dim] (RoPE applied to k).
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] or None. None means a
                dense causal pass over one sequence (tests and the chunk precompute).
            attn_metadata: None together with ``kv_cache=None``.
            scale: softmax scale (usually head_dim ** -0.5).

        Returns:
            [num_tokens, num_heads, head_dim].
        """
