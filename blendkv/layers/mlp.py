"""Gated MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))`` (SiLU for Llama/Qwen2)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from blendkv.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]
        self.fused_gate_up = None  # set by fuse() once weights are loaded

    def fuse(self) -> None:
        """One GEMM for gate/up from now on (parameters become views; names unchanged)."""
        from blendkv.layers.fused import FusedLinear

        self.fused_gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)
