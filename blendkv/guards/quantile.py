"""The high percentile a fidelity target promises, and the quantile both the calibration
(:mod:`blendkv.guards.calibration`) and the fidelity controller
(:mod:`blendkv.guards.fidelity_controller`) take of divergences. Kept apart from the
calibration, which reaches the blend code, so the engine's controller imports no blending."""

from __future__ import annotations

QUANTILE = 0.9  # the share of requests a target promises


def quantile(values: list[float], q: float = QUANTILE) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
