"""Attention / KV-cache kernels: the torch reference backend and (optional) GPU backends.

Nothing device-specific is imported here; GPU backends import Triton/xFormers inside themselves.
"""

from __future__ import annotations

from blendkv.kernels.attention import AttentionBackend, AttentionMetadata, KVCacheSpec

BACKENDS = ("auto", "torch")


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """Pick an attention backend by name; ``auto`` is the torch backend on CPU."""
    if name in ("auto", "torch"):
        from blendkv.kernels.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionMetadata", "KVCacheSpec", "get_attention_backend"]
