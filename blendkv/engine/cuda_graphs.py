"""Decode steps replayed from captured CUDA graphs (vLLM's approach to launch overhead).

A pure-decode batch's forward is captured once per padded batch size (1, 2, 4, 8, 16, 24, ...
up to ``max_num_seqs``) over static buffers; a step copies its inputs into the smallest size
that fits and replays. Capturable because: shapes are static (padded batch, block table as wide
as ``max_model_len``); padded rows are inert (slot -1, one key, position 0); no tensor is made
during capture (the backend's per-metadata layout is built by the warm-up run and kept alive
with the graph); only backends with ``supports_cuda_graphs`` and connectors without per-layer
hooks. ``capture`` is injectable (the tests pass an eager stand-in on the CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from blendkv.kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)

_SIZES = (1, 2, 4, 8) + tuple(range(16, 513, 8))

# replay(before): segment k runs after before(k) (see CudaGraphCapture.segments)
SegmentsReplay = Callable[[Callable[[int], None]], None]


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in _SIZES if s < max_num_seqs]
    return [*sizes, max_num_seqs]


class CudaGraphCapture:
    """Captures ``fn()`` into a CUDA graph; ``replay`` re-runs it. All graphs share one pool."""

    def __init__(self, error_mode: str = "global") -> None:
        """``error_mode``: torch.cuda.graph's ``capture_error_mode``; ``"thread_local"`` lets
        other threads (the K/V loader) allocate and copy while this one captures."""
        self.pool = None
        self.error_mode = error_mode

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        fn()  # warm-up on a side stream is what torch.cuda.graph expects; twice like vLLM
        torch.cuda.synchronize()
        (graph,), out = self._capture(lambda cut: fn())
        return graph.replay, out

    def segments(self, fn: Callable[[Callable[[], None]], object]) -> SegmentsReplay:
        """Captures ``fn(cut)`` as consecutive graphs, a new one from each ``cut()`` on (one
        pool: they replay in capture order). ``replay(before)`` calls ``before(k)`` ahead of
        segment k's replay: the host may order the stream there (wait for an event), which a
        graph cannot do inside."""
        fn(lambda: None)  # warm-up
        torch.cuda.synchronize()
        graphs, _ = self._capture(fn)

        def replay(before: Callable[[int], None]) -> None:
            for k, graph in enumerate(graphs):
                before(k)
                graph.replay()

        return replay

    def _capture(self, fn) -> tuple[list, object]:
        """``fn(cut)`` captured into one graph per segment: (the graphs, what ``fn`` returned).
        However a capture ends, the stream current before it is current again (when
        ``capture_end`` raises, ``torch.cuda.graph`` leaves its capture stream current: later
        work would run unordered with the default stream's)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graphs: list = []
        scope: list = []

        def begin() -> None:
            graphs.append(torch.cuda.CUDAGraph())
            scope.append(
                torch.cuda.graph(graphs[-1], pool=self.pool, capture_error_mode=self.error_mode)
            )
            scope[-1].__enter__()

        def end(exc: BaseException | None = None) -> None:
            ctx = scope.pop()
            try:
                ctx.__exit__(type(exc) if exc else None, exc, exc and exc.__traceback__)
            except BaseException:
                ctx.stream_ctx.__exit__(None, None, None)
                if exc is None:
                    raise  # (else the error that broke the capture is the one reported)

        def cut() -> None:
            end()
            begin()

        begin()
        try:
            out = fn(cut)
        except BaseException as exc:
            if scope:
                end(exc)
            raise
        end()
        return graphs, out


class EagerCapture:
    """Stand-in without a GPU: "replay" runs the forward again on the same static buffers."""

    def __call__(self, fn):
        holder = {"out": fn()}

        def replay() -> None:
            holder["out"].copy_(fn())

        return replay, holder["out"]

    def segments(self, fn: Callable[[Callable[[], None]], object]) -> SegmentsReplay:
        """A "replay" runs ``fn`` again, calling ``before(k)`` where segment k begins: what
        the graphs' replay orders, segment by segment."""
        fn(lambda: None)

        def replay(before: Callable[[int], None]) -> None:
            segment = iter(range(1, 1 << 30))
            before(0)
            fn(lambda: before(next(segment)))

        return replay


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        capture: Callable | None = None,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.capture = capture or CudaGraphCapture()
        device = attn_backend.device
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        # Per size, the backend's layouts for its metadata: the graph reads their tensors at every
        # replay, so they live as long as the graph (a GPU run once crashed with an illegal
        # memory access after the backend's memo had dropped them).
        self.retained: dict[int, list] = {}
        self.failed: str | None = None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
            is_contiguous_prefill=[True] * size,
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first (the others reuse its memory pool)."""
        for size in reversed(self.sizes):
            md = self._metadata(size)
            ids = self.input_ids[:size]

            def forward(ids=ids, md=md):
                for layer in self.model.model.layers:  # no stale cos/sin baked in
                    layer.self_attn.rotary_emb.clear_memo()  # (Gemma 3: two RoPE tables)
                return self.model(ids, md.positions, self.kv_caches, md)

            forward()  # warm-up: the backend builds its layout for this metadata object
            self._graphs[size] = self.capture(forward)
            self.retained[size] = self.attn_backend.step_layouts(md)

    def can_run(self, md: AttentionMetadata) -> bool:
        """A pure decode batch that fits a captured size (captures on first use; if capturing
        fails the engine logs why once and decodes eagerly from then on)."""
        fits = (
            md.max_query_len == 1
            and md.num_seqs <= self.sizes[-1]
            and md.max_seq_len <= self.max_model_len
            and all(md.is_contiguous_prefill)
        )
        if not fits or self.failed is not None:
            return False
        if not self._graphs:
            try:
                self.capture_all()
            except Exception as exc:  # noqa: BLE001  (any capture failure: fall back to eager)
                self.failed = f"{type(exc).__name__}: {exc}"
                self._graphs.clear()
                self.retained.clear()
                logger.warning("CUDA graph capture failed, decoding eagerly: %s", self.failed)
                return False
        return True

    def run(self, input_ids: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of the decode step described by ``md``."""
        n = md.num_seqs
        size = next(s for s in self.sizes if s >= n)
        width = md.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(md.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self.seq_lens[n:size].fill_(1)
        self.positions[n:size].fill_(0)
        self.block_table[:n, :width].copy_(md.block_table, non_blocking=True)
        replay, out = self._graphs[size]
        replay()
        return out[:n]
