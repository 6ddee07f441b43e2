"""Small jitted helpers shared by the Triton attention kernels (soft-capping)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` (logit soft-capping, Gemma 2), through the sigmoid: ``tanh(x) =
    2 sigmoid(2x) - 1`` saturates to +-1 instead of overflowing."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)
