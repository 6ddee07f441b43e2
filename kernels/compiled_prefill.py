"""Prefill attention on the CPU through one C++ kernel call per sequence and layer
(``EngineConfig.compile_prefill``): ``torch.ops.blendkv_cpu.rows_attention``
(``kernels/cpu/rows_attention.cpp``, built for this machine with the decode kernel by
:mod:`blendkv.kernels.cpu_extension`).

It takes rows at any ascending positions over the sequence's keys: CacheBlend's scattered
recomputed rows, ProphetKV's pass rows, chunked-prefill chunks, prefix-hit tails and plain
causal prefills alike, each row over exactly the keys up to its position (no masked pairs
computed past a block's diagonal, no partial results to merge). The eager CPU paths it
replaces (:func:`~blendkv.kernels.split_attention.split_masked_attention` for scattered rows,
SDPA's causal flash kernel for fresh prefills) stay the reference the tests hold it to.

Measured on the 2-core AMD EPYC (6,300 keys, two threads; ms a call, the eager path in
brackets; ``eval_results/bench/amd/rows_kernel_micro.{py,log}``): SmolLM2's heads (9 on 3 KV
heads, D 64), 720 scattered rows 35.4 (48.1), a causal 6,300-token prefill 260 (317);
Qwen2.5-0.5B's (14 on 2) 51.6 (67.6) and 394 (476); bfloat16 1.38-1.46x faster than its eager
paths.
"""

from __future__ import annotations

import torch

# Consecutive rows per task: G * 32 query rows share each key block (32 measured best of
# 8-64 above).
BLOCK_ROWS = 32


class CompiledPrefill:
    """The C++ kernel, built and loaded when made (raises
    :class:`~blendkv.kernels.cpu_extension.CPUKernelBuildError` when it cannot be)."""

    def __init__(self) -> None:
        from blendkv.kernels.cpu_extension import load_ops

        self.ops = load_ops()

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        mass: torch.Tensor | None = None,
    ) -> None:
        """``out`` [n, Hq, D] = attention of ``q`` [n, Hq, D] (rows at strictly ascending
        ``positions`` [n]) over ``keys``/``values`` [S, Hkv, D] at positions 0..S-1.

        ``mass`` [S] float32 (contiguous): adds the softmax probability the rows pay each key,
        summed over rows and query heads (ProphetKV's score,
        :func:`~blendkv.kernels.attention_mass.query_attention_mass`), from a second pass over
        the scores (no P.V): the query rows' attention and their score in one call."""
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
        )
        if dst is not out:
            out.copy_(dst)

    def causal(self, q, k, v, scale, out) -> None:
        """A fresh prefill: rows and keys both at positions 0..n-1."""
        self(q, k, v, torch.arange(q.shape[0], device=q.device), scale, out)
