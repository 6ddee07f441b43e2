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

# Consecutive rows per task: G * 32 query rows share each key block (the best of 8-64 on the CPU).
BLOCK_ROWS = 32


class RowsKernel:
    """The C++ kernel. ``ops``: ``torch.ops.blendkv_cpu``; built and loaded here when None
    (raises :class:`~blendkv.kernels.cpu_extension.CPUKernelBuildError` when it cannot be)."""

    def __init__(self, ops=None) -> None:
        if ops is None:
            ops = load_ops()
        self.ops = ops

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
        :func:`~blendkv.kernels.attention_mass.query_attention_mass`), from a second pass over
        the scores (no P.V): the query rows' attention and their score in one call.

        ``window``: a row at ``p`` sees keys ``p - window < j <= p`` (the keys before every
        row's window are not read); ``soft_cap``: scores ``cap * tanh(s / cap)``."""
        dst = out if out.is_contiguous() else torch.empty_like(q)
        self.ops.rows_attention(
            q.contiguous(),
            keys.contiguous(),
            values.contiguous(),
            positions.contiguous(),
            scale,
            BLOCK_ROWS,
            dst,
            mass,
            0 if window is None else int(window),
            0.0 if soft_cap is None else float(soft_cap),
        )
        if dst is not out:
            out.copy_(dst)

    def causal(self, q, k, v, scale, out, window=None, soft_cap=None) -> None:
        """A fresh prefill: rows and keys both at positions 0..n-1."""
        positions = torch.arange(q.shape[0], device=q.device)
        self(q, k, v, positions, scale, out, window=window, soft_cap=soft_cap)
