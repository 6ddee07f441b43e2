"""Fuse sibling projections into one GEMM while keeping their checkpoint parameter names.

``fuse_linears(parent, ["q_proj", "k_proj", "v_proj"])`` concatenates the weights (and biases)
into one tensor and turns each ``Linear``'s parameters into views of it, so ``named_parameters``
and ``state_dict`` are unchanged while one matmul computes all three outputs (a single larger
GEMM is measurably faster on CPU for prefill-sized batches). Call it after weights are loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from blendkv.layers.linear import SmallBatchGemm


class FusedLinear:
    """The concatenated weight/bias of several ``nn.Linear``s, and their output sizes."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.sizes = [lin.out_features for lin in linears]
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        has_bias = [lin.bias is not None for lin in linears]
        assert all(has_bias) or not any(has_bias), "all or none of the fused linears have bias"
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
        self.gemm = SmallBatchGemm()  # packed for small batches once enabled (layers.linear)
        start = 0
        for lin, size in zip(linears, self.sizes, strict=True):
            lin.weight = nn.Parameter(self.weight[start : start + size], requires_grad=False)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[start : start + size], requires_grad=False)
            start += size

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.gemm(x, self.weight, self.bias).split(self.sizes, dim=-1)
