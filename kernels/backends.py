"""Choosing an attention backend by name (``EngineConfig.attention_backend``), and the blend's
kernels that go with it (:func:`get_blend_kernels`).

Each backend's module is imported only when it is chosen: Triton is never imported on a
machine that does not use it.
"""

from __future__ import annotations

import os

import torch

from blendkv.config import KernelConfig
from blendkv.kernels.attention import AttentionBackend
from blendkv.kernels.blend_kernels import BlendKernels
from blendkv.kernels.cpu_attention import CpuAttentionBackend
from blendkv.kernels.cpu_blend import CpuBlendKernels
from blendkv.kernels.torch_attention import TorchAttentionBackend

BACKENDS = ("auto", "torch", "cpu", "triton")


def get_attention_backend(
    name: str = "auto",
    device: str = "cpu",
    deterministic: bool = False,
    kernels: KernelConfig | None = None,
) -> AttentionBackend:
    """The backend ``name`` on ``device``; ``deterministic``: batch-invariant attention
    (:mod:`blendkv.kernels.batch_invariant`); ``kernels``: the Triton prefill kernel's choices
    (the defaults when None)."""
    backend = _backend(name, device, kernels or KernelConfig())
    backend.deterministic = deterministic
    return backend


def get_blend_kernels(backend: AttentionBackend) -> BlendKernels:
    """The blend's kernels on ``backend``'s pool: Triton's with the ``triton`` backend, the C++
    ones with the ``cpu`` backend when its C++ ops built, else the torch reference."""
    if backend.name == "triton":  # (its module is imported only when it was chosen)
        from blendkv.kernels.triton_attention import TritonAttentionBackend
        from blendkv.kernels.triton_blend import TritonBlendKernels

        assert isinstance(backend, TritonAttentionBackend)
        return TritonBlendKernels(backend)
    if isinstance(backend, CpuAttentionBackend) and backend.ops is not None:
        return CpuBlendKernels(backend, backend.ops)
    return BlendKernels(backend)


def _compile_only() -> bool:
    """Whether Triton's active driver compiles for a GPU without running anything."""
    try:
        from triton.runtime import driver

        return bool(getattr(driver.active, "compile_only", False))
    except Exception:  # noqa: BLE001  (no triton, or no GPU driver here: it runs nothing)
        return False


def _backend(name: str, device: str, kernels: KernelConfig) -> AttentionBackend:
    """Pick an attention backend by name; ``auto`` is Triton on CUDA and ``cpu`` on the CPU.

    ``torch`` is the plain-torch reference (any device); ``cpu`` is it with the C++ kernels in
    its place where they apply (:mod:`blendkv.kernels.cpu_attention`).

    ``triton`` on the CPU needs ``TRITON_INTERPRET=1`` set before the kernels are first imported
    (the tests do that); it is the GPU path, run slowly on the CPU for verification.
    """
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "cpu"
    if name == "torch":
        return TorchAttentionBackend(device)
    if name == "cpu":
        return CpuAttentionBackend(device)
    if name == "triton":
        # On the CPU: interpreted (tests), or compiled for a GPU and never run (`blendkv bench
        # compile` makes Triton's active driver one that only compiles).
        on_cpu = os.environ.get("TRITON_INTERPRET") == "1" or _compile_only()
        if torch.device(device).type != "cuda" and not on_cpu:
            raise ValueError(
                "the triton attention backend runs on CUDA; on the CPU it needs "
                "TRITON_INTERPRET=1 (slow, for verification) -- use attention_backend='cpu'"
            )
        try:
            from blendkv.kernels.triton_attention import TritonAttentionBackend

            return TritonAttentionBackend(device, kernels)
        except ImportError as exc:
            raise ValueError(
                f"the triton attention backend needs triton ({exc}); pip install 'blendkv[gpu]'"
            ) from exc
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
