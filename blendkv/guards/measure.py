"""What a fidelity target measures: the largest next-token KL over the answer's first
``ANSWER_TOKENS`` tokens, summarised over requests by its ``QUANTILE`` (the share of requests a
target promises). The calibration (:mod:`blendkv.guards.calibration`), the audit
(:mod:`blendkv.guards.audit`) and the fidelity controller
(:mod:`blendkv.guards.fidelity_controller`) share them. Torch-free and apart from the
calibration (which reaches the blend code), so the engine and the CLI's parser import neither
torch nor blending through it."""

from __future__ import annotations

# The answer positions a divergence is measured over: the calibration's and the audit's.
ANSWER_TOKENS = 16
QUANTILE = 0.9  # the share of requests a target promises


def quantile(values: list[float], q: float = QUANTILE) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
