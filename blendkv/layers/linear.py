"""Linear layers whose GEMMs use a weight packed once on the CPU (MKL or oneDNN).

For a decode step's few dozen rows, MKL's sgemm spends much of each call packing the weight;
packing it once (``torch.ops.mkl._mkl_reorder_linear_weight``) removes that. The packed GEMM
runs only for the row count it was packed for, so batches of more than half of ``rows`` are
padded up to ``rows``; others use ``F.linear``. Float32 only; packed lazily on first use (costs
the weight's size again); equal to ``F.linear`` to fp32 rounding.

**oneDNN** (:mod:`blendkv.layers.cpu_platform`'s choice off Intel): every GEMM through
``_linear_pointwise`` on a weight reordered once, float32 and bfloat16; differs from
``F.linear`` by rounding. Why each library where: docs/benchmarks.md.
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


def onednn_gemm_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether oneDNN's packed linear can run: float32, or bfloat16 on a CPU oneDNN has bf16
    kernels for (AVX-512 or AVX-NE-CONVERT), on a CPU build with oneDNN."""
    return (
        torch.device(device).type == "cpu"
        and (
            dtype == torch.float32
            or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...; ``unknown`` where
    /proc/cpuinfo does not say): BLAS libraries pick their kernels by it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


class OneDNNWeight:
    """A weight reordered once into oneDNN's layout; GEMMs of any number of rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert weight.dtype in (torch.float32, torch.bfloat16), weight.dtype
        assert weight.device.type == "cpu", weight.device
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )


def row_tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """``F.linear`` through GEMMs of exactly ``rows`` rows each: a row's result does not depend
    on how many rows came with it. GEMM libraries choose their kernel and reduction order by
    the row count (a matrix-vector product for one row, other blockings for others); with the
    count fixed every row goes through the same kernel, whose reduction over the inner
    dimension is the same for each row of a tile."""
    n = x.shape[0]
    pad = -n % rows
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    out = x.new_empty(n + pad, weight.shape[0])
    for start in range(0, n + pad, rows):
        out[start : start + rows] = F.linear(x[start : start + rows], weight, bias)
    return out[:n]


class SmallBatchGemm:
    """The packing policy of one linear map: off until :meth:`enable` (MKL, small batches) or
    :meth:`enable_onednn` (every 2-D input), packed on first use."""

    def __init__(self) -> None:
        self.rows = 0  # 0 = off
        self.onednn = False
        self.packed: PackedWeight | OneDNNWeight | None = None
        self.tile_rows = 0  # batch-invariant row tiles (enable_row_tiles); 0 = off

    def enable(self, rows: int) -> None:
        self.rows, self.onednn, self.packed = rows, False, None

    def enable_onednn(self) -> None:
        self.rows, self.onednn, self.packed = 0, True, None

    def enable_row_tiles(self, rows: int) -> None:
        """Batch-invariant from now on (``EngineConfig.deterministic``): every GEMM in tiles
        of exactly ``rows`` rows, the last one zero-padded (:func:`row_tiled_linear`)."""
        self.rows, self.onednn, self.packed, self.tile_rows = 0, False, None, rows

    def __call__(self, x, weight, bias) -> torch.Tensor:
        if self.tile_rows and x.dim() == 2:
            return row_tiled_linear(x, weight, bias, self.tile_rows)
        if self.onednn and x.dim() == 2:
            if self.packed is None:
                self.packed = OneDNNWeight(weight, bias)
            return self.packed(x)
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
