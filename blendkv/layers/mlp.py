"""Gated MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))`` (SiLU for Llama/Qwen2)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from blendkv.layers.fused import FusedLinear
from blendkv.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.hidden_act = hidden_act
        self.act_fn = ACT2FN[hidden_act]
        self.fused_gate_up = None  # set by fuse() once weights are loaded
        # ``act(gate) * up`` of the fused gate/up output in one launch (GPUs, SiLU only; set by
        # blendkv.layers.fused_kernels); None = torch ops.
        self.act_and_mul = None
        # Rows per pass through the MLP (set by blendkv.layers.cpu_platform on the CPU); more
        # rows than this run in slices of it. None = all rows at once.
        self.rows_per_pass: int | None = None

    def fuse(self) -> None:
        """One GEMM for gate/up from now on (parameters become views; names unchanged)."""
        self.fused_gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows_per_pass
        if rows is None or x.shape[0] <= rows:
            return self._forward(x)
        # Rows are independent; slices of equal size (no tail of a few rows, which GEMM
        # libraries hand to other kernels) change at most the rounding.
        n = x.shape[0]
        step = -(-n // -(-n // rows))
        out = x.new_empty(n, self.down_proj.weight.shape[0])
        for start in range(0, n, step):
            out[start : start + step] = self._forward(x[start : start + step])
        return out

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_gate_up
        if fused is not None and self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(fused.gemm(x, fused.weight, fused.bias)))
        if fused is not None:
            gate, up = fused(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # in place on the activation's new tensor: one pass less (the same bits)
        return self.down_proj(self.act_fn(gate).mul_(up))
