"""Host values copied to the device without the host waiting for the device.

A plain ``tensor.to(cuda)`` or ``torch.tensor(values, device=cuda)`` copies from pageable
memory, after which torch synchronizes the stream: the host waits for every kernel queued
before the copy, and the device then idles while the host issues the next ones. A step's
metadata and a blend's row indices are such copies, many per request. These copy from pinned
memory with ``non_blocking`` instead (vLLM does the same); the caching host allocator keeps
the pinned block until the transfer is done. On the CPU they are the plain calls.

Never inside a CUDA graph capture: a captured copy would read the (by then reused) pinned
block at every replay. They raise there, so the capture fails and its caller runs eagerly.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, the host not waiting for the copy."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():  # (not fake CUDA tensors)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a host-to-device copy inside a CUDA graph capture")
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def upload_list(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, the host not waiting for the copy."""
    return upload(torch.tensor(values, dtype=dtype), device)
