"""Linear layers whose small-batch GEMMs use a pre-packed weight on the CPU.

A decode step multiplies a few dozen rows by every weight of the model. For so few rows MKL's
sgemm spends much of each call packing the weight into its kernel's layout; packing it once
(``torch.ops.mkl._mkl_reorder_linear_weight``, the op inductor's CPU freezing uses) removes that.
Measured on this project's 2-core CPU for 32 rows of SmolLM2 (best of 3): fused q/k/v 0.64x the
time of ``F.linear``, gate/up 0.58x, down 0.42x, lm_head 0.69x; a 32-request decode step 0.88x.

MKL's packed GEMM runs only for the exact row count it was packed for (other counts fall back
to the dense weight inside the op), so batches of more than half of ``rows`` rows are padded
with zero rows up to ``rows``; smaller and larger batches use ``F.linear``. Float32 on a CPU
build with MKL only (sgemm). The packed copy costs the weight's size again in memory; it is
made on the first call that uses it, so projections never called (the q/k/v of a fused
q/k/v, say) cost nothing. Results equal ``F.linear``'s to fp32 rounding; on the embedded
model's shapes they are bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def packed_gemm_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether MKL's packed sgemm can run: float32 on a CPU build with MKL."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


class PackedWeight:
    """A weight packed once for GEMMs of ``rows`` rows (padded up from more than half)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
        assert weight.dtype == torch.float32 and weight.device.type == "cpu", weight
        self.rows = rows
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m < self.rows:
            x = torch.cat((x, x.new_zeros(self.rows - m, x.shape[1])))
        out = torch.ops.mkl._mkl_linear(
            x.contiguous(), self.packed, self.weight, self.bias, self.rows
        )
        return out[:m]


class SmallBatchGemm:
    """The packing policy of one linear map: off until :meth:`enable`, packed on first use."""

    def __init__(self) -> None:
        self.rows = 0  # 0 = off
        self.packed: PackedWeight | None = None

    def enable(self, rows: int) -> None:
        self.rows, self.packed = rows, None

    def __call__(self, x, weight, bias) -> torch.Tensor:
        if self.rows and x.dim() == 2 and self.rows // 2 < x.shape[0] <= self.rows:
            if self.packed is None:
                self.packed = PackedWeight(weight, bias, self.rows)
            return self.packed(x)
        return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) that can pack its weight for small batches."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gemm = SmallBatchGemm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.bias)


def small_batch_gemms(model: nn.Module) -> list[SmallBatchGemm]:
    """The packing policy of every linear map of ``model``: its ``Linear`` modules and its
    fused projections (:class:`~blendkv.layers.fused.FusedLinear`)."""
    from blendkv.layers.fused import FusedLinear

    gemms = [m.gemm for m in model.modules() if isinstance(m, Linear)]
    for m in model.modules():
        gemms += [f.gemm for f in vars(m).values() if isinstance(f, FusedLinear)]
    return gemms


def enable_packed_gemm(model: nn.Module, rows: int) -> None:
    """Pack (lazily) every linear map of ``model`` for batches of ``rows // 2 + 1 .. rows``
    rows; 0 switches packing off and frees the packed copies. The weights must not change
    while packing is on."""
    for gemm in small_batch_gemms(model):
        gemm.enable(rows)
