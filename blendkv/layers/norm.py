"""RMSNorm computed in float32 like transformers, with vLLM's fused residual add; Gemma's
``(1 + w)`` variant."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * normalize(x)``; the normalisation runs in float32 and is cast back first.

    ``forward(x)`` returns the normalised tensor. ``forward(x, residual)`` first adds
    ``residual`` (in the input dtype, exactly where transformers adds it) and returns
    ``(normalised, x + residual)`` — the new residual stream, vLLM's convention. With the
    one-launch kernel set (GPUs) that call writes both results into ``x`` and ``residual``
    themselves: callers pass tensors they no longer need.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        # One-launch kernel (same signature as forward, residual updated in place) set by
        # blendkv.layers.fused_kernels on GPUs; None = the torch code below.
        self.kernel = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = h.to(input_dtype)  # a new tensor either way (the product above, or the cast)
        if h.dtype != torch.promote_types(h.dtype, self.weight.dtype):
            return self.weight * h
        return h.mul_(self.weight)  # weight * h, in place (the product is commutative)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (
            self.kernel is not None
            and x.dim() == 2
            and x.dtype == self.weight.dtype
            and x.stride(1) == 1
            and (residual is None or residual.stride(1) == 1)
        ):
            return self.kernel(x, self.weight, self.variance_epsilon, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``normalize(x) * (1 + weight)`` all in float32, cast back last (the
    checkpoint stores ``weight`` as an offset from 1), exactly as transformers computes it.

    Never takes :class:`RMSNorm`'s one-launch kernel (that one multiplies by ``weight`` after
    the cast): ``blendkv.layers.fused_kernels`` matches exact types, and ``kernel`` stays None.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).type_as(x)
