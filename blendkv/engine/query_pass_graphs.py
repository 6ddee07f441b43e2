"""A query pass replayed from one CUDA graph per padded row count.

A query pass (ProphetKV's first stage, :mod:`blendkv.blend.prophet`; the model runner runs it)
runs a few dozen rows (template, query) through
every layer over the loaded K/V. On a GPU its time is the host's: a layer's RoPE, attention,
score and dense piece, and the Python around them, once per layer. Captured whole, the pass is
one launch. Capturable because nothing in it depends on the request except device tensors:

- static buffers of ``max_rows`` rows (ids, positions, slots, the positions the score reads)
  and one sequence's block table as wide as ``max_model_len``; a request copies its rows into
  the smallest captured size that fits. Padding rows repeat the last row's position (a tile's
  last row bounds the keys it reads), write no K/V (slot -1) and score nothing.
- every row is scored, at position -1 (seeing no key) unless it is a query row: where the
  query rows start varies by request, their positions are data;
- a size's metadata object is built once with that size's Python mirrors (one sequence of
  ``max_model_len`` keys): the backend's layout for it (tiles, key parts) is built by the
  warm-up run, and both live as long as the graph (which holds only its memory pool); the
  kernels read the real key count from ``seq_lens`` (a part past it, or a score block past
  it, does nothing);
- loading overlaps the pass: a graph cannot wait for the loader's events inside, so the pass
  is captured as consecutive graphs cut where the loader's stages begin
  (:func:`~blendkv.engine.kv_connector.load_stages`: layers 0, 1-2, 3-6, 7-14, ...), and the
  host orders the stream on a stage's loaded K/V before replaying its segment, as the eager
  pass waits at each layer (one replay of the whole pass would wait for every layer's loads
  first, losing the overlap).

It runs for a step with one ProphetKV sequence on a backend whose attention leaves the rows'
log-sum-exp (``query_scoring == "from_lse"``: the Triton one), else the pass runs eagerly. A
capture that fails turns it off for the engine, logged once. ``capture`` is injectable (the
tests pass the eager stand-in of :mod:`blendkv.engine.cuda_graphs` on the CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from blendkv.engine.cuda_graphs import CudaGraphCapture, SegmentsReplay
from blendkv.engine.kv_connector import load_stages
from blendkv.kernels.attention import AttentionMetadata, QueryScoring
from blendkv.models.hooks import LayerHooks, RowPlan

logger = logging.getLogger(__name__)

_SIZES = (8, 16, 32, 64, 128, 256)


def pass_sizes(max_rows: int) -> list[int]:
    """The padded row counts the pass is captured for, up to ``max_rows``."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return [s for s in _SIZES if s < max_rows] + [max_rows]


class _StaticScores(RowPlan):
    """The query pass's row plan over the static buffers: keeps every row, scores every row
    at its score position (-1: none) after each layer's attention, and at the last layer
    (stopped after its projections) rotates and writes the rows itself first."""

    def __init__(self, graphs: QueryPassGraphs, size: int, last_layer: int) -> None:
        self.graphs = graphs
        self.size = size
        self.last_layer = last_layer
        self.rows = torch.arange(size)
        self.key_slots: torch.Tensor | None = None  # set by each run (inside the capture)
        self._scoring = QueryScoring(lse_out=graphs.lse[:size])

    def scoring(self) -> QueryScoring:
        return self._scoring

    def selects_at(self, layer_idx: int) -> bool:
        return layer_idx == self.last_layer

    def select(self, layer_idx, attn, q, k, v, kv_cache, attn_metadata):
        md = attn_metadata
        backend = self.graphs.attn_backend
        q_rot, _ = attn.rotary_emb.rotate_and_write(
            md.positions, q, k, v, kv_cache, md.slot_mapping, backend.write_kv
        )
        self._score(attn, q_rot, kv_cache, None)
        return None

    def after_attention(self, layer_idx, attn, q_rot, kv_cache, attn_metadata) -> None:
        self._score(attn, q_rot, kv_cache, self._scoring.lse_out)

    def _score(self, attn, q_rot, kv_cache, lse) -> None:
        g = self.graphs
        g.attn_backend.add_query_mass(
            g.scores,
            q_rot,
            g.score_positions[: self.size],
            kv_cache,
            self.key_slots,
            0,
            **attn.mass_kwargs(),
            lse=lse,
            key_count=g.seq_lens,
        )


class _Cuts(LayerHooks):
    """Hooks of the captured pass: a new segment (graph) from each stage's first layer on."""

    def __init__(self, starts: set[int], cut: Callable[[], None]) -> None:
        self.starts = starts
        self.cut = cut

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if layer_idx in self.starts:
            self.cut()


class QueryPassGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_rows: int = 256,
        capture: Callable | None = None,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = pass_sizes(max_rows)
        self.capture = capture or CudaGraphCapture(error_mode="thread_local")
        device = attn_backend.device
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.num_keys = max_blocks * block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.score_positions = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(1, max_blocks, dtype=torch.int32, device=device)
        self.key_positions = torch.arange(self.num_keys, device=device)
        self.scores = torch.zeros(self.num_keys, dtype=torch.float32, device=device)
        attn = model.model.layers[0].self_attn
        self.lse = torch.zeros(n, attn.num_heads, dtype=torch.float32, device=device)
        # Layer ranges replayed as one graph each: the loader's stages (each waits for its
        # stage's loaded K/V).
        self.stages = load_stages(len(model.model.layers))
        self._graphs: dict[int, SegmentsReplay] = {}
        # Per size, the backend's layouts for its metadata: the graph reads their tensors at
        # every replay, so they live as long as the graph.
        self.retained: dict[int, list] = {}
        self.failed: str | None = None
        self.replays = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def buffers(self) -> list[torch.Tensor]:
        """The static buffers the graphs read and write."""
        return [
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.score_positions,
            self.seq_lens,
            self.block_table,
            self.key_positions,
            self.scores,
            self.lse,
        ]

    def can_run(self, num_rows: int, seq_len: int) -> bool:
        """Whether the query pass of one sequence (``num_rows`` rows, ``seq_len`` keys)
        replays here."""
        backend = self.attn_backend
        if self.failed is not None or backend.query_scoring != "from_lse":
            return False
        cuda = backend.device.type == "cuda" and torch.cuda.is_available()
        if cuda and torch.cuda.is_current_stream_capturing():
            return False
        return 0 < num_rows <= self.sizes[-1] and seq_len <= self.num_keys

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        first_query_row: int,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        wait_for_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor | None:
        """The scores [max keys] float32 (the static buffer: read them before the next run) of
        one sequence's query pass: its ``input_ids`` / ``positions`` / ``slot_mapping`` rows,
        the query rows from ``first_query_row`` on, its ``seq_lens`` [1] and ``block_table``
        [blocks] on the device. ``wait_for_layer(i)``: returns once layer i's loaded K/V is in
        the pool (CUDA: orders the stream), called for a stage's layers before its segment
        replays. None if the capture failed (run the pass eagerly)."""
        wait = wait_for_layer or (lambda layer: None)
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.positions[n:size].copy_(positions[n - 1 :].expand(size - n))
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.score_positions[:size].fill_(-1)
        self.score_positions[first_query_row:n].copy_(positions[first_query_row:])
        self.seq_lens.copy_(seq_lens)
        self.block_table[0, : len(block_table)].copy_(block_table)
        replay = self._graphs.get(size)
        if replay is None:
            for layer in range(self.stages[-1][1]):  # the capture's runs read every layer
                wait(layer)
            try:
                replay = self._capture(size)
            except Exception as exc:  # noqa: BLE001  (any capture failure: eager from now on)
                self.failed = f"{type(exc).__name__}: {exc}"
                self._graphs.clear()
                self.retained.clear()
                logger.warning(
                    "query pass CUDA graph capture failed, running it eagerly: %s", self.failed
                )
                return None

        def before(segment: int) -> None:
            for layer in range(*self.stages[segment]):
                wait(layer)

        replay(before)
        self.replays += 1
        return self.scores

    def _metadata(self, size: int) -> AttentionMetadata:
        device = self.positions.device
        return AttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            block_size=self.block_size,
            max_query_len=size,
            max_seq_len=self.num_keys,
            query_start_loc_cpu=[0, size],
            seq_lens_cpu=[self.num_keys],
            is_contiguous_prefill=[False],
        )

    @torch.inference_mode()
    def _capture(self, size: int) -> SegmentsReplay:
        md = self._metadata(size)
        layers = self.model.model.layers
        plan = _StaticScores(self, size, len(layers) - 1)
        bs = self.block_size
        starts = {lo for lo, _ in self.stages[1:]}

        def forward(cut: Callable[[], None]) -> torch.Tensor:
            for layer in layers:  # no stale cos/sin baked in
                layer.self_attn.rotary_emb.clear_memo()
            table = self.block_table[0].long()
            plan.key_slots = table[self.key_positions // bs] * bs + self.key_positions % bs
            self.scores.zero_()
            self.model(
                self.input_ids[:size],
                md.positions,
                self.kv_caches,
                md,
                row_plan=plan,
                hooks=_Cuts(starts, cut),
                kv_only=True,
            )
            return self.scores

        forward(lambda: None)  # warm-up: the backend builds its layout for this metadata
        replay = self.capture.segments(forward)
        self._graphs[size] = replay
        # The graph keeps only its pool: the metadata (its ``query_start_loc`` is no view of a
        # static buffer) and the backend's layouts must live as long as it does (an H200 run
        # hit an illegal memory access once the freed metadata's memory was reused).
        self.retained[size] = [md, plan, *self.attn_backend.step_layouts(md)]
        return replay
