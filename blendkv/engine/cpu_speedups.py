"""The engine's CPU speed options, checked and switched on at start-up.

``EngineConfig.cpu_gemm`` / ``packed_gemm_rows`` choose how the model's linear maps run on the
CPU (oneDNN on weights reordered once, MKL's packed sgemm for decode-sized batches, or plain
``F.linear``; :mod:`blendkv.layers.linear`), ``compile_decode`` / ``compile_prefill`` whether
decode rows / prefill rows go through the C++ attention kernels
(:mod:`blendkv.kernels.compiled_decode`, :mod:`blendkv.kernels.compiled_prefill`). Bad
combinations raise :class:`~blendkv.errors.ConfigError` before anything is packed.
"""

from __future__ import annotations

import logging

import torch

from blendkv.errors import ConfigError

logger = logging.getLogger(__name__)


def setup_cpu_gemm(
    model, name: str, packed_rows: int | None, dtype: torch.dtype, device: str
) -> tuple[str, int]:
    """Resolve ``cpu_gemm`` and switch it on for ``model``; returns ``(library, packed rows)``:
    ``("onednn", 0)`` or ``("mkl", rows)`` (``"mkl"`` with 0 rows also where neither packs:
    other dtypes and devices run ``F.linear``)."""
    from blendkv.layers.linear import enable_onednn_gemm

    library = resolve_cpu_gemm(name, packed_rows, dtype, device)
    if library == "onednn":
        enable_onednn_gemm(model)
        return library, 0
    return library, enable_packed_gemm_rows(model, packed_rows, dtype, device)


def resolve_cpu_gemm(name: str, packed_rows: int | None, dtype: torch.dtype, device: str) -> str:
    """``EngineConfig.cpu_gemm`` -> "onednn" or "mkl"."""
    from blendkv.layers.linear import cpu_vendor, onednn_gemm_available

    available = onednn_gemm_available(dtype, device)
    if name == "auto":
        intel = cpu_vendor() == "GenuineIntel"
        # packed_gemm_rows given: the caller tunes MKL's packing
        return "onednn" if available and not intel and packed_rows is None else "mkl"
    if name == "onednn":
        if not available:
            raise ConfigError(
                "cpu_gemm='onednn' needs float32 or bfloat16 on a CPU build of torch with "
                f"oneDNN (got dtype {_name(dtype)} on {device}); use cpu_gemm='auto'"
            )
        if packed_rows:
            raise ConfigError(
                "packed_gemm_rows sets MKL's packed GEMMs; cpu_gemm='onednn' packs every "
                "GEMM already (leave packed_gemm_rows unset or use cpu_gemm='mkl')"
            )
    return name


def enable_packed_gemm_rows(model, rows: int | None, dtype: torch.dtype, device: str) -> int:
    """Pack the model's weights for decode-sized GEMMs where MKL's packed sgemm runs
    (``EngineConfig.packed_gemm_rows``); returns the row count, 0 when off."""
    from blendkv.layers.linear import enable_packed_gemm, packed_gemm_available

    available = packed_gemm_available(dtype, device)
    if rows is None:
        rows = 32 if available else 0
    elif rows and not available:
        raise ConfigError(
            f"packed_gemm_rows={rows} needs float32 on a CPU build of torch with MKL "
            f"(got dtype {_name(dtype)} on {device}); use packed_gemm_rows=0 or None"
        )
    if rows:
        enable_packed_gemm(model, rows)
    return rows


# glibc maps allocations above its mmap threshold (raised as mapped blocks are freed, to at
# most 32 MiB on 64-bit) fresh from the kernel and unmaps them on free, so every use of a
# larger buffer page-faults all of it in again. An MLP pass whose gate/up output stays under
# this reuses freed heap memory instead.
MLP_PASS_BYTES = 24 << 20


def setup_mlp_rows(model, rows: int | None, dtype: torch.dtype, device: str) -> int:
    """``EngineConfig.mlp_rows_per_pass`` -> rows per MLP pass set on every GatedMLP of
    ``model``; returns it (0: all rows at once)."""
    from blendkv.layers.mlp import GatedMLP

    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    if rows is None:
        if device != "cpu" or not mlps:
            return 0
        widest = max(m.gate_proj.weight.shape[0] for m in mlps)
        row_bytes = 2 * widest * torch.empty((), dtype=dtype).element_size()
        rows = max(64, MLP_PASS_BYTES // row_bytes)
    for m in mlps:
        m.rows_per_pass = rows or None
    return rows


def setup_compiled_decode(
    attn_backend, wanted: bool | None, dtype: torch.dtype, device: str
) -> bool:
    """``EngineConfig.compile_decode``: the C++ decode kernel (:func:`_setup_cpp_kernel`)."""
    return _setup_cpp_kernel(
        "compile_decode", attn_backend.enable_compiled_decode, attn_backend, wanted, dtype, device
    )


def setup_compiled_prefill(
    attn_backend, wanted: bool | None, dtype: torch.dtype, device: str
) -> bool:
    """``EngineConfig.compile_prefill``: the C++ prefill kernel (:func:`_setup_cpp_kernel`)."""
    return _setup_cpp_kernel(
        "compile_prefill", attn_backend.enable_compiled_prefill, attn_backend, wanted, dtype, device
    )


def _setup_cpp_kernel(option, enable, attn_backend, wanted, dtype, device) -> bool:
    """A C++ attention kernel for the torch backend on the CPU, float32 or bfloat16. ``None``
    switches it on where it applies, ``True`` raises where it cannot. Builds the kernels
    (cached after the first time); returns whether it runs. A build failure is logged (a
    warning when it was asked for) and attention runs the eager flash calls."""
    from blendkv.kernels.cpu_extension import CPUKernelBuildError

    what = option.removeprefix("compile_")  # decode / prefill
    if wanted is False:
        return False
    applies = attn_backend.name == "torch" and device == "cpu"
    if wanted is None and not (applies and dtype in (torch.float32, torch.bfloat16)):
        return False
    if not applies:
        raise ConfigError(
            f"{option} needs the torch attention backend on the CPU "
            f"(got {attn_backend.name} on {device})"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"{option} needs dtype float32 or bfloat16, got {_name(dtype)}")
    try:
        enable()
    except CPUKernelBuildError as exc:
        level = logging.WARNING if wanted else logging.INFO
        logger.log(
            level,
            "%s: the C++ %s kernel is unavailable, %s runs the eager flash calls: %s",
            option,
            what,
            what,
            exc,
        )
        return False
    return True


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
