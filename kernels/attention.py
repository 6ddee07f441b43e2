"""The attention backend interface (the metadata it builds: :mod:`.attention_metadata`).

The backend owns everything about the paged KV pool: allocating it, turning a step's layout
into metadata tensors, writing K/V into blocks, reading them back and attention. The model
calls ``backend.forward(q, k, v, kv_cache, attn_metadata)`` once per layer; the runner and
the KV connectors never index the pool themselves. Tokens of all sequences in a step are
flattened into one dimension (no batch dimension), vLLM-style::

    tokens:           | seq 0 (3 new) | seq 1 (1 new) | seq 2 (4 new)  |
    query_start_loc:  0               3               4                8
    seq_lens:         [ 3,              17,             4 ]   (context incl. new tokens)
    positions:        per token, the absolute position of that token in its sequence

Masking rule (the only one): a query token at position ``p`` sees exactly the keys of its own
sequence at positions ``<= p`` (and ``> p - window`` on a sliding-window layer). Query
positions need not be contiguous (CacheBlend recomputes scattered rows), and keys at positions
that are not being computed this step must already be in the paged cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from blendkv.kernels.attention_mass import query_attention_mass
from blendkv.kernels.attention_metadata import (  # re-exported: their historical home
    AttentionMetadata,
    StepLayoutMemo,
    kept_rows,
    split_by_kind,
)
from blendkv.kernels.query_scoring import QueryMassRequest, QueryScoring, ScoringKind

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCacheSpec",
    "QueryMassRequest",
    "QueryScoring",
    "StepLayoutMemo",
    "kept_rows",
    "split_by_kind",
]


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV pool: one ``[2, num_blocks, block_size, kv_heads, head_dim]``
    tensor per layer (index 0 = K after RoPE, 1 = V)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class AttentionBackend(ABC):
    """Owns the paged KV pool's layout: metadata, K/V writes and reads, attention."""

    name: str = "abstract"
    # Decode attention reads sequence lengths from the device tensors and sizes its launches
    # from the metadata's Python mirrors only, so a padded decode step can be graph-captured.
    supports_cuda_graphs: bool = False
    # Its writes may run in a second host thread while the forward runs (pipelined loading).
    thread_safe: bool = True
    # It reads a sequence's blocks faster when their ids are consecutive (slices of the pool,
    # no gather): the block manager then places new blocks in runs.
    prefers_block_runs: bool = False
    # How ProphetKV's query pass scores keys on it (blendkv.kernels.query_scoring): "apart"
    # (add_query_mass after attention), "in_attention" (its forward adds the mass of
    # ``scoring.requests``) or "from_lse" (its forward fills ``scoring.lse_out``, which
    # add_query_mass takes).
    query_scoring: ScoringKind = "apart"
    # Batch-invariant mode (EngineConfig.deterministic, set by get_attention_backend): every
    # query row attended as its own decode row (blendkv.kernels.batch_invariant).
    deterministic: bool = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def step_layouts(self, md: AttentionMetadata) -> list[Any]:
        """What this backend derived from ``md`` and still remembers (index tensors, tiles). A
        CUDA graph captured over ``md`` reads these tensors at replay without asking again:
        the capturer keeps them alive (the memo forgets them after a few other steps)."""
        return []

    # ---- the pool -----------------------------------------------------------------------
    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[torch.Tensor]:
        """One zeroed KV tensor per layer, ``spec.layer_shape``, on this backend's device.

        The layers are views of one ``[num_layers, *layer_shape]`` allocation, so a kernel can
        reach every layer from the first with one stride (RoPE at load writes all layers of a
        chunk in one launch).
        """
        pool = torch.zeros(
            (spec.num_layers, *spec.layer_shape), dtype=spec.dtype, device=self.device
        )
        # Single-view indexing, not unbind(): in-place writes into unbind's outputs are refused
        # outside inference mode.
        return [pool[i] for i in range(spec.num_layers)]

    @abstractmethod
    def write_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Scatter ``k``/``v`` [num_tokens, kv_heads, head_dim] into their slots."""

    @abstractmethod
    def read_kv(
        self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V held at ``slot_mapping``: [num_tokens, kv_heads, head_dim] each, new tensors
        (copies, not views of the pool: the caller may write them)."""

    @abstractmethod
    def copy_blocks(self, kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``(src, dst)`` in every layer (copy-on-write)."""

    # ---- metadata -----------------------------------------------------------------------
    @abstractmethod
    def build_metadata(
        self,
        num_computed_tokens: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> AttentionMetadata:
        """Metadata for a step where sequence ``i`` computes positions
        ``[num_computed_tokens[i], num_computed_tokens[i] + query_lens[i])`` into the blocks of
        ``block_tables[i]``."""

    @abstractmethod
    def dense_metadata(self, seq_lens: list[int]) -> AttentionMetadata:
        """Metadata for a pass without a KV pool: sequence ``i`` is ``seq_lens[i]`` fresh tokens
        at positions 0..n-1 (chunk precompute)."""

    # ---- attention ----------------------------------------------------------------------
    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
        scale: float,
        *,
        window: int | None = None,
        soft_cap: float | None = None,
        out: torch.Tensor | None = None,
        kv_written: bool = False,
        scoring: QueryScoring | None = None,
    ) -> torch.Tensor:
        """Write this layer's new K/V into the pool (unless ``kv_written``: the caller did,
        with RoPE: ``Attention.rotate_and_write``), then attend.

        Args:
            q: [num_tokens, num_heads, head_dim] (RoPE applied).
            k, v: [num_tokens, num_kv_heads, head_dim] (RoPE applied to k).
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], or None for a pass
                without a pool (dense metadata, or ``attn_metadata=None``: one sequence).
            scale: softmax scale (usually head_dim ** -0.5).
            window: sliding window (per layer): a query at position ``p`` sees keys at
                ``p - window < j <= p`` (transformers' rule); None: every key ``<= p``.
            soft_cap: logit soft-capping: scores ``cap * tanh(scale * q.k / cap)`` before the
                softmax (Gemma 2); None: none. A backend path that cannot honour ``window`` or
                ``soft_cap`` raises ``NotImplementedError`` naming itself, never ignores them.

            out: [num_tokens, num_heads, head_dim] to write the result into (the graph
                buffer the next dense piece reads); None: a new tensor.
            scoring: ProphetKV's query pass, as :attr:`query_scoring` says this backend
                takes it (None: not a query pass).

        Returns:
            [num_tokens, num_heads, head_dim] (``out`` when given).
        """

    # ---- the blend's scoring -------------------------------------------------------------
    def add_query_mass(
        self,
        scores: torch.Tensor,
        q: torch.Tensor,
        q_positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        visible_prefix: int = 0,
        *,
        scale: float | None = None,
        window: int | None = None,
        soft_cap: float | None = None,
        lse: torch.Tensor | None = None,
        key_count: torch.Tensor | None = None,
    ) -> None:
        """``scores`` [S] float32 += the softmax attention ``q`` [Q, H, D] (RoPE applied, rows
        at ``q_positions``) pays each key of positions ``0..S-1``, read from ``kv_cache`` at
        ``slots`` [S] (the query rows' own K already written), summed over rows and heads.
        ``visible_prefix``: how many leading keys every row sees (spares their masking).
        ``scale`` (None: ``D ** -0.5``), ``window``, ``soft_cap``: the layer's, as in
        :meth:`forward`. ``lse`` [Q, H]: the rows' log-sum-exp as this layer's attention left
        it (``query_scoring == "from_lse"``); the reference here computes its own.
        ``key_count`` int32 [1]: the sequence's keys on the device, when ``slots`` run past them
        (a captured pass); no query row sees those keys, so the reference needs no cut.

        ProphetKV's query pass calls it at each layer, once the rows' K/V are in the pool, on
        backends that do not score ``"in_attention"``. This is the reference (dense torch)."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        flat_k = kv_cache[0].view(num_blocks * block_size, num_kv_heads * head_dim)
        keys = flat_k.index_select(0, slots).view(-1, num_kv_heads, head_dim)  # K only
        key_positions = torch.arange(len(slots), device=slots.device)
        scores += query_attention_mass(
            q,
            keys,
            q_positions,
            key_positions,
            visible_prefix,
            scale=scale,
            window=window,
            soft_cap=soft_cap,
        )
