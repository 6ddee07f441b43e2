"""The dense pieces of every non-decode forward replayed from CUDA graphs (vLLM V1's piecewise
graphs, without torch.compile).

A prefill, a chunked prefill or a blended forward (both ProphetKV passes) runs its layers'
dense work (norms, the Q/K/V, ``o_proj`` and MLP GEMMs, activations) as a few launches each
from Python, and on a GPU those launches, not the device, set the time when a layer computes
few rows (the query pass, a blend's recomputed rows). The model's layer loop hands each dense
piece between two attentions to :meth:`PiecewiseGraphs.run` (:mod:`blendkv.models.pieces`):
here it is captured once per piece and padded row count, then replayed (one launch).
Attention, RoPE and the row plan's hooks stay eager between the pieces: their shapes and
metadata change every step.

Static memory: one buffer per role (``ids``, ``heads``, ``res``, ``q``, ``k``, ``v``,
``hidden``) of ``max_rows`` rows, shared by every piece and size (pieces run one at a time). A
piece of padded size S reads its inputs from the buffers' first S rows (a tensor already in
place, such as the residual the piece before left, is not copied) and writes its outputs into
them, returning views of the real rows. Padding rows hold stale values: harmless, since every
op in a piece works row by row. Outputs stay valid until the next piece runs (every consumer
is on the same stream, so in order).

Rows above ``max_rows`` run eagerly (their GEMMs dwarf the launches); a capture that fails
turns graphs off for the engine, logged once. ``capture`` is injectable (the tests pass the
eager stand-in of :mod:`blendkv.engine.cuda_graphs` on the CPU).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Hashable

import torch

from blendkv.engine.cuda_graphs import CudaGraphCapture
from blendkv.models.pieces import Pieces

logger = logging.getLogger(__name__)

_SIZES = (
    (1, 2, 4)
    + tuple(range(8, 256, 8))
    + tuple(range(256, 1024, 32))
    + tuple(range(1024, 8193, 128))
)
# Which buffers each kind of piece reads and writes (LlamaModel's pieces).
_ROLES = {
    "first": (("ids",), ("q", "k", "v", "res")),
    "link": (("heads", "res"), ("q", "k", "v", "res")),
    "last": (("heads", "res"), ("hidden",)),
}


def piece_sizes(max_rows: int) -> list[int]:
    """The padded row counts pieces are captured for, up to ``max_rows``."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return [s for s in _SIZES if s < max_rows] + [max_rows]


class PiecewiseGraphs(Pieces):
    def __init__(
        self, device: torch.device | str, max_rows: int = 2048, capture: Callable | None = None
    ) -> None:
        self.device = torch.device(device)
        self.sizes = piece_sizes(max_rows)
        self.capture = capture or CudaGraphCapture(error_mode="thread_local")
        self._buffers: dict[str, torch.Tensor] = {}  # by role, max_rows rows each
        self._graphs: dict[tuple[Hashable, int], Callable[[], object]] = {}
        self.failed: str | None = None
        self.replays = 0  # pieces replayed (and eager runs below) since construction
        self.eager_runs = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def buffers(self) -> list[torch.Tensor]:
        """The static buffers the graphs read and write."""
        return list(self._buffers.values())

    def run(self, key, fn, inputs):
        n = inputs[0].shape[0]
        if not self._replayable(n):
            self.eager_runs += 1
            return fn(*inputs)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        reads, writes = _ROLES[key[0]]
        replay = self._graphs.get((key, size))
        if replay is None:
            try:
                replay = self._capture(key, size, fn, inputs)
            except Exception as exc:  # noqa: BLE001  (any capture failure: eager from now on)
                self.failed = f"{type(exc).__name__}: {exc}"
                self._graphs.clear()
                self._buffers.clear()
                logger.warning(
                    "piecewise CUDA graph capture failed, running eagerly: %s", self.failed
                )
                self.eager_runs += 1
                return fn(*inputs)
        self._fill(reads, inputs)
        replay()
        self.replays += 1
        return tuple(self._buffers[role][:n] for role in writes)

    def output(self, role: str, rows: int) -> torch.Tensor | None:
        """The first ``rows`` rows of the role's buffer when the piece reading it will replay
        (attention writes its heads there: one copy less a layer)."""
        buf = self._buffers.get(role)
        if buf is None or not self._replayable(rows):
            return None
        return buf[:rows]

    def _replayable(self, n: int) -> bool:
        if self.failed is not None or n == 0 or n > self.sizes[-1]:
            return False
        # (inside another capture, e.g. a decode graph's forward, pieces run as recorded there)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        return not (cuda and torch.cuda.is_current_stream_capturing())

    def _buffer(self, size: int, role: str, like: torch.Tensor) -> torch.Tensor:
        """The first ``size`` rows of the role's buffer (made like ``like`` on first use)."""
        buf = self._buffers.get(role)
        if buf is None:
            rows = self.sizes[-1]
            buf = torch.zeros(rows, *like.shape[1:], dtype=like.dtype, device=like.device)
            self._buffers[role] = buf
        return buf[:size]

    def _fill(self, roles: tuple[str, ...], inputs) -> None:
        """Copy the inputs not already in place into their buffers."""
        for role, x in zip(roles, inputs, strict=True):
            buf = self._buffers[role]
            if x.data_ptr() != buf.data_ptr():
                buf[: x.shape[0]].copy_(x)

    def _capture(self, key, size: int, fn, inputs) -> Callable[[], object]:
        reads, writes = _ROLES[key[0]]
        # An input may be a buffer this piece also writes (the residual): keep its values, the
        # warm-up runs below overwrite it.
        saved = [x.clone() for x in inputs]
        args = [self._buffer(size, role, x) for role, x in zip(reads, inputs, strict=True)]
        self._fill(reads, saved)
        outs = fn(*args)  # eagerly at the padded size: the outputs' shapes
        targets = [self._buffer(size, role, out) for role, out in zip(writes, outs, strict=True)]

        def piece() -> torch.Tensor:
            for target, out in zip(targets, fn(*args), strict=True):
                target.copy_(out)
            return targets[0]

        replay, _ = self.capture(piece)
        self._graphs[key, size] = replay
        self.captures += 1
        self._fill(reads, saved)
        return replay
