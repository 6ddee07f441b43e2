"""The seams of the one forward path: which rows each layer computes, and layer-boundary hooks.

``LlamaModel.forward`` is the only place decoder layers run. What varies between a plain step,
a blended prefill and a chunk precompute plugs in here, never by attributes set from outside:

    for each layer l:                         (LlamaModel.forward: the seam, then layer(...))
        hooks.wait_for_layer_load(l)          K/V of layer l brought from outside is in place
        row_plan.select(l, None x 3, ...)     if it selects_before_projection(l)
      dense piece (blendkv.models.pieces)     layer l-1's o_proj, post-norm, MLP; layer l's
                                              norm, project -> q, k, v (pre-RoPE)
      layer(...)                              (LlamaDecoderLayer.forward, through LayerSeam)
        row_plan.select(l, ...)               rows that stop being computed from layer l on
        row_plan.before_attention(l, ...)     last look at the pool before attention writes
        RoPE (writes the fresh K/V), attention  with row_plan.scoring() (a query pass's)
        row_plan.after_attention(l, ...)      the rows' RoPE'd queries, their K/V in the pool
        hooks.save_kv_layer(l, k, v, ...)     K/V of layer l computed this step, to save

Without a plan every row runs every layer; without hooks nothing waits or saves. With
``output_rows`` the last layer writes every row's K/V and attends (and runs the MLP) only for
the rows the caller reads (:func:`output_keep`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from blendkv.kernels.attention import AttentionMetadata
    from blendkv.kernels.query_scoring import QueryScoring
    from blendkv.layers.attention import Attention


class LayerRows(NamedTuple):
    """The rows a layer computes: their positions and attention metadata (None: a dense pass
    without a KV pool over one sequence)."""

    positions: torch.Tensor
    attn_metadata: AttentionMetadata | None

    def subset(self, keep: torch.Tensor) -> LayerRows:
        """The rows of the CPU bool mask ``keep``."""
        md = self.attn_metadata.subset(keep)
        return LayerRows(md.positions, md)


class RowPlan(ABC):
    """Which of a step's rows each layer computes (a shrinking set).

    ``rows`` holds, after the forward, the indices (into the step's rows) of the rows whose
    final hidden states the forward returned, in order.
    """

    rows: torch.Tensor

    @abstractmethod
    def selects_at(self, layer_idx: int) -> bool:
        """True when :meth:`select` must be called at this layer."""

    def selects_before_projection(self, layer_idx: int) -> bool:
        """True when this layer's :meth:`select` needs no fresh q/k/v (scores known before the
        layer, and nothing written for the rows it drops): it is then called before the input
        norm with ``q = k = v = None``, and the rows it drops skip the projections too."""
        return False

    @abstractmethod
    def select(
        self,
        layer_idx: int,
        attn: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Given the layer's fresh pre-RoPE q/k/v of the current rows, return a CPU bool keep-mask
        over them (None = keep all). Rows dropped keep the K/V already in the pool from here
        on. The plan updates :attr:`rows` itself."""

    def scoring(self) -> QueryScoring | None:
        """What attention scores for the plan at every layer (ProphetKV's query pass), passed
        to the backend's forward; None (the default): nothing."""
        return None

    def before_attention(  # noqa: B027  (optional hook: most plans repair nothing)
        self,
        layer_idx: int,
        attn: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> None:
        """Called at every layer with the pre-RoPE q/k/v of the rows that compute it, before
        attention writes their K/V: the pool still holds what was there (e.g. reused K/V),
        which the plan may read or repair for rows it does not compute. Default: nothing."""

    def after_attention(  # noqa: B027  (optional hook)
        self,
        layer_idx: int,
        attn: Attention,
        q_rot: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> None:
        """Called at every layer that attends (not a ``kv_only`` last layer, nor one whose
        outputs are pruned) with the rows' RoPE'd queries, once attention has written their
        K/V into the pool and read it. Default: nothing."""


@dataclass(frozen=True)
class QueryPassReplay:
    """One sequence's query pass as a captured graph replays it (``QueryPassGraphs.run``): its
    rows' ids, positions and slots, where its query rows start, its ``seq_lens`` [1] and block
    table on the device, and its key count."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    first_query_row: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    seq_len: int


@dataclass
class QueryPass:
    """A pass of a few rows run before a fused forward, over the K/V already in the pool: the
    model runner runs ``input_ids`` at ``attn_metadata`` through the layer loop following
    ``row_plan`` (which scores keys as it goes), or replays it from a captured graph
    (``replay``, None when it cannot). ``kv_only``: the last layer stops after its
    projections."""

    input_ids: torch.Tensor
    attn_metadata: AttentionMetadata
    row_plan: QueryPassPlan
    kv_only: bool
    replay: QueryPassReplay | None = None


class QueryPassPlan(RowPlan):
    """A query pass's row plan: keeps every row and scores keys as the layers run."""

    @abstractmethod
    def begin(self) -> None:
        """The pass is about to run eagerly: set up the scores."""

    @abstractmethod
    def finish(self) -> None:
        """The eager pass ran: bring the scores where their reader takes them."""

    @abstractmethod
    def take_replayed(self, scores: torch.Tensor) -> None:
        """The pass was replayed from a captured graph instead: its scores [seq_len] float32
        (a view of a static buffer: read before the next replay)."""


class LayerHooks:
    """Layer-boundary callbacks (the worker side of a KV connector implements them)."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until K/V of ``layer_idx`` loaded from outside is in the pool."""

    def save_kv_layer(
        self,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> None:
        """Fresh K (pre-RoPE) and V of the rows computed at ``layer_idx``; ``kv_cache`` (if any)
        already holds them (post-RoPE K) at ``attn_metadata.slot_mapping``."""


def output_keep(
    row_plan: RowPlan | None, output_rows: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Of the ``num_rows`` rows computed at the last layer (``row_plan.rows``, or all the
    step's rows), those in ``output_rows``: (CPU bool mask, their ascending indices); None when
    that is all of them. (No ``nonzero``: on a device it would be a host sync.)"""
    rows = row_plan.rows if row_plan is not None else torch.arange(num_rows)
    keep = torch.isin(rows, output_rows)
    if bool(keep.all()):
        return None
    return keep, torch.searchsorted(rows, output_rows[torch.isin(output_rows, rows)])


def output_row_order(
    row_plan: RowPlan | None, output_rows: torch.Tensor | None, num_rows: int
) -> torch.Tensor:
    """The step rows whose final hidden states ``LlamaModel.forward`` returned, in order."""
    rows = row_plan.rows if row_plan is not None else torch.arange(num_rows)
    if output_rows is None:
        return rows
    return rows[torch.isin(rows, output_rows)]


@dataclass(frozen=True)
class LayerSeam:
    """Layer ``layer_idx``'s share of one forward's row plan and hooks: what the model's layer
    loop and the decoder layer call, each a no-op without a plan or hooks. ``kv_only`` and
    ``output_rows`` are set on the last layer only (see ``LlamaModel.forward``)."""

    layer_idx: int
    row_plan: RowPlan | None = None
    hooks: LayerHooks | None = None
    kv_only: bool = False  # stop once this layer's K/V is saved (chunk precompute)
    output_rows: torch.Tensor | None = None  # rows whose outputs are read (None: all)

    def _selects(self, before_projection: bool) -> bool:
        plan, i = self.row_plan, self.layer_idx
        return (
            plan is not None
            and plan.selects_at(i)
            and plan.selects_before_projection(i) == before_projection
        )

    def select_unprojected(
        self, attn: Attention, kv_cache: torch.Tensor | None, attn_metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """Keep-mask of the rows computing this layer, when the plan selects before projection."""
        if not self._selects(before_projection=True):
            return None
        return self.row_plan.select(self.layer_idx, attn, None, None, None, kv_cache, attn_metadata)

    def select_projected(
        self,
        attn: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Keep-mask of the rows computing this layer on from its fresh q/k/v (other plans)."""
        if not self._selects(before_projection=False):
            return None
        return self.row_plan.select(self.layer_idx, attn, q, k, v, kv_cache, attn_metadata)

    def before_attention(self, attn, q, k, v, kv_cache, attn_metadata) -> None:
        """:meth:`RowPlan.before_attention` of this layer."""
        if self.row_plan is not None:
            self.row_plan.before_attention(self.layer_idx, attn, q, k, v, kv_cache, attn_metadata)

    def scoring(self) -> QueryScoring | None:
        """:meth:`RowPlan.scoring`, None without a plan."""
        return self.row_plan.scoring() if self.row_plan is not None else None

    def after_attention(self, attn, q_rot, kv_cache, attn_metadata) -> None:
        """:meth:`RowPlan.after_attention` of this layer."""
        if self.row_plan is not None:
            self.row_plan.after_attention(self.layer_idx, attn, q_rot, kv_cache, attn_metadata)

    def save_kv(self, k, v, kv_cache, attn_metadata) -> None:
        """:meth:`LayerHooks.save_kv_layer` of this layer."""
        if self.hooks is not None:
            self.hooks.save_kv_layer(self.layer_idx, k, v, kv_cache, attn_metadata)

    def output_keep(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:func:`output_keep` of this layer's ``num_rows`` rows; None when all are read."""
        if self.output_rows is None:
            return None
        return output_keep(self.row_plan, self.output_rows, num_rows)
