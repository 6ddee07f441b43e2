"""How the model's layer loop runs its dense pieces (the work between two attentions).

``LlamaModel.forward`` calls ``pieces.run(key, fn, inputs)`` for each dense piece: the
embeddings and layer 0's input norm and projections (``("first",)``), layer ``i - 1``'s
``o_proj``, post-norm and MLP with layer ``i``'s input norm and projections (``("link", i)``),
the last layer's tail and the final norm (``("last",)``). ``fn(*inputs)`` computes the piece;
its first input's rows are the piece's rows, and every op in it works row by row. A runner
may compute it eagerly (:class:`Pieces`, the default) or replay it from a CUDA graph captured for a
padded row count (:class:`blendkv.engine.piecewise_graphs.PiecewiseGraphs`): the function is
the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


class Pieces:
    """Runs the dense pieces of a forward; this base class runs them eagerly."""

    captures = 0  # graphs captured so far (a step that captured is no timing to learn from)

    def run(
        self, key: Hashable, fn: Callable[..., tuple], inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """``fn(*inputs)`` (or the same from a replay): a tuple of tensors with the inputs'
        rows."""
        return fn(*inputs)

    def output(self, role: str, rows: int) -> torch.Tensor | None:
        """Where a value the next piece reads (``"heads"``: attention's output, [rows, H * D])
        can be written in place, so that piece finds it there and nothing is copied; None
        (here: always) to leave it to a new tensor."""
        return None


EAGER_PIECES = Pieces()
