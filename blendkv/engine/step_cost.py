"""What a step costs, in seconds, learned from the steps this engine ran. Pure Python.

A step's time is modelled as linear in three counts the scheduler knows before it runs::

    seconds = a * forwards + b * rows + c * key_rows

``forwards``: model forwards (the batch, each chunk precompute, a query pass): the per-forward
overhead of the layer loop, launches and the Python around them, which dominates a small
chunk's precompute; ``rows``: tokens computed (GEMMs, MLP); ``key_rows``: (row, key) pairs
attended (attention grows with the context). The coefficients are fitted by recursive least
squares with exponential forgetting over the runner's measured steps, so they follow the
machine (another process taking a core, a warmer cache). Until enough varied steps were seen
the model predicts nothing (``None``) and the scheduler budgets by tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

_FEATURES = 3
_PRIOR = 1e6  # the uncertainty of a coefficient nothing was measured of (scaled units)


@dataclass(frozen=True)
class StepWork:
    """The counts of some work of a step (see the module docstring)."""

    forwards: int = 0
    rows: int = 0
    key_rows: int = 0

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(
            self.forwards + other.forwards, self.rows + other.rows, self.key_rows + other.key_rows
        )

    def features(self) -> tuple[float, float, float]:
        return (float(self.forwards), float(self.rows), float(self.key_rows))


def prefill_work(num_computed: int, num_new: int) -> StepWork:
    """``num_new`` prompt rows after ``num_computed`` cached ones, each attending to every key up
    to its own position (no forward of its own: it rides in the step's batch)."""
    n, c = num_new, num_computed
    return StepWork(0, n, n * c + n * (n + 1) // 2)


def chunk_forward_work(num_tokens: int) -> StepWork:
    """One forward of ``num_tokens`` fresh tokens (a chunk precompute, an audit)."""
    return StepWork(1, num_tokens, num_tokens * (num_tokens + 1) // 2)


class StepCostModel:
    """Fits ``seconds = a * forwards + b * rows + c * key_rows`` online.

    ``forgetting`` in (0, 1]: the weight of a past step falls by this factor per step;
    ``min_steps``: steps seen before it predicts."""

    def __init__(self, forgetting: float = 0.97, min_steps: int = 8) -> None:
        assert 0.0 < forgetting <= 1.0
        self.forgetting = forgetting
        self.min_steps = min_steps
        self.num_steps = 0
        # the inverse of the (weighted) Gram matrix, started as a weak prior
        self._p = [[_PRIOR if i == j else 0.0 for j in range(_FEATURES)] for i in range(_FEATURES)]
        self._theta = [0.0] * _FEATURES
        self._scale = [1.0] * _FEATURES  # features are scaled to ~1 for a well-posed update

    @classmethod
    def with_rates(cls, per_forward: float, per_row: float, per_key_row: float) -> StepCostModel:
        """A model that already predicts with these rates (seconds per forward, per row, per
        key-row): for tests and simulations; it keeps learning from what it records."""
        model = cls()
        model._theta = [per_forward, per_row, per_key_row]
        model.num_steps = model.min_steps
        return model

    def record(self, work: StepWork, seconds: float) -> None:
        """A step (or a forward) that did ``work`` took ``seconds``."""
        if seconds <= 0.0 or work.forwards + work.rows == 0:
            return
        x = self._scaled(work.features(), grow=True)
        p, lam = self._p, self.forgetting
        px = [sum(p[i][j] * x[j] for j in range(_FEATURES)) for i in range(_FEATURES)]
        denom = lam + sum(x[i] * px[i] for i in range(_FEATURES))
        gain = [v / denom for v in px]
        error = seconds - sum(t * v for t, v in zip(self._theta, x, strict=True))
        self._theta = [t + g * error for t, g in zip(self._theta, gain, strict=True)]
        self._p = [
            [(p[i][j] - gain[i] * px[j]) / lam for j in range(_FEATURES)] for i in range(_FEATURES)
        ]
        self._bound_uncertainty()
        self.num_steps += 1

    def _bound_uncertainty(self, cap: float = _PRIOR) -> None:
        """Forgetting inflates the uncertainty of a count no recent step varied (every step
        decodes, say) without end; hold it at the prior's."""
        p = self._p
        for i in range(_FEATURES):
            if p[i][i] > cap:
                f = (cap / p[i][i]) ** 0.5
                for j in range(_FEATURES):
                    p[i][j] *= f
                    p[j][i] *= f

    def predict(self, work: StepWork) -> float | None:
        """Predicted seconds of ``work``; None until ``min_steps`` steps were recorded."""
        if self.num_steps < self.min_steps:
            return None
        x = self._scaled(work.features(), grow=False)
        # a coefficient fitted below zero (noise) is read as zero: no work is free of cost
        return sum(max(0.0, t) * v for t, v in zip(self._theta, x, strict=True))

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(seconds per forward, per row, per key-row), or None until it predicts."""
        if self.num_steps < self.min_steps:
            return None
        return tuple(max(0.0, t) / s for t, s in zip(self._theta, self._scale, strict=True))

    def _scaled(self, x: tuple[float, ...], grow: bool) -> list[float]:
        """``x`` divided by per-feature scales fixed by the first non-zero value seen, so the
        update works on numbers near 1 (rows count hundreds, key-rows millions)."""
        if grow:
            for i, v in enumerate(x):
                if self._scale[i] == 1.0 and v > 1.0:
                    self._rescale(i, v)
        return [v / s for v, s in zip(x, self._scale, strict=True)]

    def _rescale(self, i: int, scale: float) -> None:
        """Count feature ``i`` (not seen yet) in units of ``scale``: its coefficient follows, so
        predictions do not change, and its uncertainty is the prior's in the new units."""
        f = scale / self._scale[i]
        self._scale[i] = scale
        self._theta[i] *= f
        for j in range(_FEATURES):
            self._p[i][j] = self._p[j][i] = 0.0
        self._p[i][i] = _PRIOR
