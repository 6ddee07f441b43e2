"""Choosing an attention backend by name (``EngineConfig.attention_backend``).

Each backend's module is imported only when it is chosen: Triton is never imported on a
machine that does not use it.
"""

from __future__ import annotations

import os

import torch

from blendkv.kernels.attention import AttentionBackend

BACKENDS = ("auto", "torch", "triton")


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """Pick an attention backend by name; ``auto`` is Triton on CUDA and torch on the CPU.

    ``triton`` on the CPU needs ``TRITON_INTERPRET=1`` set before the kernels are first imported
    (the tests do that); it is the GPU path, run slowly on the CPU for verification.
    """
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "torch"
    if name == "torch":
        from blendkv.kernels.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend(device)
    if name == "triton":
        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "the triton attention backend runs on CUDA; on the CPU it needs "
                "TRITON_INTERPRET=1 (slow, for verification) -- use attention_backend='torch'"
            )
        try:
            from blendkv.kernels.triton_attention import TritonAttentionBackend

            return TritonAttentionBackend(device)
        except ImportError as exc:
            raise ValueError(
                f"the triton attention backend needs triton ({exc}); pip install 'blendkv[gpu]'"
            ) from exc
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
