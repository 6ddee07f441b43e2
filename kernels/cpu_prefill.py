"""Prefill rows on the CPU through one C++ kernel call per sequence and layer:
``torch.ops.blendkv_cpu.rows_attention`` (``kernels/cpu/rows_attention.cpp``, built for this
machine by :mod:`blendkv.kernels.cpu_extension`). The ``cpu`` attention backend's prefill.

It takes rows at any ascending positions over the sequence's keys: CacheBlend's scattered
recomputed rows, ProphetKV's pass rows, chunked-prefill chunks, prefix-hit tails and plain
causal prefills alike, each row over exactly the keys up to its position (no masked pairs
computed past a block's diagonal, no partial results to merge). The torch reference
(:mod:`blendkv.kernels.torch_attention`: SDPA's causal flash kernel, split attention for
scattered rows) is what the tests hold it to; timings are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import torch

from blendkv.kernels.cpu_extension import load_ops

# Query rows per task, at most (G query heads per row): they share each key block the task
# reads (``blendkv bench attention`` times it against 32 rows). The kernel splits a call's rows
# finer when that few tasks would leave threads idle.
BLOCK_QUERY_ROWS = 288


def block_rows(group: int) -> int:
    """Rows per task for ``group`` query heads per KV head (at least 8)."""
    return max(8, BLOCK_QUERY_ROWS // group)


# The mass from the attention pass's own probabilities needs a row of keys per task and per
# query row a worker holds (float32); past this many floats (64 MiB) the kernel recomputes the
# scores instead.
MAX_PROB_FLOATS = 1 << 24


class RowsKernel:
    """The C++ kernel. ``ops``: ``torch.ops.blendkv_cpu``; built and loaded here when None
    (raises :class:`~blendkv.kernels.cpu_extension.CPUKernelBuildError` when it cannot be)."""

    def __init__(self, ops=None, max_prob_floats: int = MAX_PROB_FLOATS) -> None:
        if ops is None:
            ops = load_ops()
        self.ops = ops
        self.max_prob_floats = max_prob_floats

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        mass: torch.Tensor | None = None,
        window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        """``out`` [n, Hq, D] = attention of ``q`` [n, Hq, D] (rows at strictly ascending
        ``positions`` [n]) over ``keys``/``values`` [S, Hkv, D] at positions 0..S-1.

        ``mass`` [S] float32 (contiguous): adds the softmax probability the rows pay each key,
        summed over rows and query heads (ProphetKV's score,
        :func:`~blendkv.kernels.attention_mass.query_attention_mass`): each task of the
        attention pass sums its rows' probabilities, then the tasks' sums are added in order
        (past ``max_prob_floats`` of buffers, a second pass recomputes the scores instead): the
        query rows' attention and their score in one call.

        ``window``: a row at ``p`` sees keys ``p - window < j <= p`` (the keys before every
        row's window are not read); ``soft_cap``: scores ``cap * tanh(s / cap)``."""
        dst = out if out.is_contiguous() else torch.empty_like(q)
        self.ops.rows_attention(
            q.contiguous(),
            keys.contiguous(),
            values.contiguous(),
            positions.contiguous(),
            scale,
            block_rows(q.shape[1] // keys.shape[1]),
            dst,
            mass,
            0 if window is None else int(window),
            0.0 if soft_cap is None else float(soft_cap),
            self.max_prob_floats,
        )
        if dst is not out:
            out.copy_(dst)

    def causal(self, q, k, v, scale, out, window=None, soft_cap=None) -> None:
        """A fresh prefill: rows and keys both at positions 0..n-1."""
        positions = torch.arange(q.shape[0], device=q.device)
        self(q, k, v, positions, scale, out, window=window, soft_cap=soft_cap)
