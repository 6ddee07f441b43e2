"""CPU tuning decided from the platform, not configured: the GEMM library of the linear maps,
the rows MKL's packed weights serve, the rows one MLP pass takes.

:func:`decide_cpu_tuning` picks them once at start-up from the device, dtype and CPU vendor:
**oneDNN** (weights reordered once) on CPUs not made by Intel, **MKL** (packed sgemm for
decode-sized batches) on Intel, plain ``F.linear`` elsewhere (docs/benchmarks.md).
``EngineConfig.cpu_gemm`` overrides the library (the goldens use MKL's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blendkv.errors import ConfigError
from blendkv.layers.fused import FusedLinear
from blendkv.layers.linear import (
    Linear,
    SmallBatchGemm,
    cpu_vendor,
    onednn_gemm_available,
    packed_gemm_available,
)
from blendkv.layers.mlp import GatedMLP

# MKL's packed weights serve GEMMs of (rows/2, rows] rows: decode batches up to this size.
PACKED_GEMM_ROWS = 32
# glibc maps allocations above its mmap threshold (raised as mapped blocks are freed, to at
# most 32 MiB on 64-bit) fresh from the kernel and unmaps them on free, so every use of a
# larger buffer page-faults all of it in again. An MLP pass whose gate/up output stays under
# this reuses freed heap memory instead.
MLP_PASS_BYTES = 24 << 20


@dataclass(frozen=True)
class CpuTuning:
    """What :func:`decide_cpu_tuning` chose. ``gemm``: ``"onednn"``, ``"mkl"`` or ``"torch"``;
    ``packed_gemm_rows``: rows MKL's packed weights serve (0: off); ``mlp_rows_per_pass``: the
    most rows one MLP pass takes (0: all at once)."""

    gemm: str
    packed_gemm_rows: int = 0
    mlp_rows_per_pass: int = 0


def resolve_gemm(choice: str, dtype: torch.dtype, device: str) -> str:
    """The GEMM library: ``choice`` (``EngineConfig.cpu_gemm``) unless ``"auto"`` (ConfigError
    where it cannot run), else oneDNN on CPUs not made by Intel and MKL on Intel's;
    ``"torch"`` where neither runs."""
    onednn = onednn_gemm_available(dtype, device)
    if choice == "onednn" and not onednn:
        raise ConfigError(
            "cpu_gemm='onednn' needs float32, or bfloat16 on a CPU with oneDNN's bf16 kernels, "
            f"on a CPU build of torch with oneDNN (got dtype {str(dtype).removeprefix('torch.')} "
            f"on {device}); use cpu_gemm='auto'"
        )
    if choice != "auto":
        return choice
    if onednn and cpu_vendor() != "GenuineIntel":
        return "onednn"
    return "mkl" if torch.device(device).type == "cpu" and dtype == torch.float32 else "torch"


def decide_cpu_tuning(
    model: nn.Module, dtype: torch.dtype, device: str, gemm: str = "auto"
) -> CpuTuning:
    """The tuning for ``model`` in ``dtype`` on ``device``; ``gemm``: ``EngineConfig.cpu_gemm``."""
    library = resolve_gemm(gemm, dtype, device)
    packed = PACKED_GEMM_ROWS if library == "mkl" and packed_gemm_available(dtype, device) else 0
    return CpuTuning(library, packed, mlp_rows_per_pass(model, dtype, device))


def mlp_rows_per_pass(model: nn.Module, dtype: torch.dtype, device: str) -> int:
    """On the CPU, the rows whose gate/up output fits :data:`MLP_PASS_BYTES`; elsewhere 0 (the
    caching allocator keeps large buffers)."""
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    if torch.device(device).type != "cpu" or not mlps:
        return 0
    widest = max(m.gate_proj.weight.shape[0] for m in mlps)
    row_bytes = 2 * widest * torch.empty((), dtype=dtype).element_size()
    return max(64, MLP_PASS_BYTES // row_bytes)


def apply_cpu_tuning(model: nn.Module, tuning: CpuTuning) -> None:
    """Set ``tuning`` on every linear map and MLP of ``model`` (weights are packed lazily, on
    first use; they must not change from then on)."""
    for gemm in small_batch_gemms(model):
        if tuning.gemm == "onednn":
            gemm.enable_onednn()
        else:
            gemm.enable(tuning.packed_gemm_rows)
    for m in model.modules():
        if isinstance(m, GatedMLP):
            m.rows_per_pass = tuning.mlp_rows_per_pass or None


def small_batch_gemms(model: nn.Module) -> list[SmallBatchGemm]:
    """The packing policy of every linear map of ``model``: its ``Linear`` modules and its
    fused projections (:class:`~blendkv.layers.fused.FusedLinear`)."""
    gemms = [m.gemm for m in model.modules() if isinstance(m, Linear)]
    for m in model.modules():
        gemms += [f.gemm for f in vars(m).values() if isinstance(f, FusedLinear)]
    return gemms
