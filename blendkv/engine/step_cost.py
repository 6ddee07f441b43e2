"""What a step costs, in seconds, learned from the steps this engine ran. Pure Python.

A step's time is modelled as linear in three counts the scheduler knows before it runs::

    seconds = a * forwards + b * rows + c * key_rows

``forwards``: model forwards (the batch, each chunk precompute, a query pass): the per-forward
overhead of the layer loop, launches and the Python around them, which dominates a small
chunk's precompute; ``rows``: tokens computed (GEMMs, MLP); ``key_rows``: (row, key) pairs
attended (attention grows with the context). The coefficients are fitted by non-negative least
squares with exponential forgetting over the runner's measured steps, so they follow the
machine (another process taking a core, a warmer cache). Until enough steps were seen the
model predicts nothing (``None``) and the scheduler budgets by tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

_FEATURES = 3


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

    The fit is non-negative least squares over every recorded step, a step's weight falling by
    ``forgetting`` (in (0, 1]) per later step; ``min_steps``: steps seen before it predicts.

    A count the recent steps barely varied (every step decodes four rows, say) leaves its
    coefficient loosely determined: a light ridge, relative to each count's own spread, holds
    it near the rates it was given (zero by default) instead of letting noise swing it, and no
    coefficient goes below zero. The scheduler does not rely on extrapolation alone either: a
    prefill piece beside decodes grows at most twofold a step
    (:class:`~blendkv.engine.scheduler.Scheduler`), so each size is measured before a larger
    one runs."""

    def __init__(self, forgetting: float = 0.97, min_steps: int = 8) -> None:
        assert 0.0 < forgetting <= 1.0
        self.forgetting = forgetting
        self.min_steps = min_steps
        self.num_steps = 0
        # the weighted Gram matrix of the counts and their products with the seconds
        self._gram = [[0.0] * _FEATURES for _ in range(_FEATURES)]
        self._moment = [0.0] * _FEATURES
        self._prior = (0.0,) * _FEATURES
        self._theta = [0.0] * _FEATURES

    @classmethod
    def with_rates(cls, per_forward: float, per_row: float, per_key_row: float) -> StepCostModel:
        """A model that already predicts with these rates (seconds per forward, per row, per
        key-row): for tests and simulations; it keeps learning from what it records, its
        rates the values a count no step varied stays near."""
        model = cls()
        model._prior = (per_forward, per_row, per_key_row)
        model._theta = list(model._prior)
        model.num_steps = model.min_steps
        return model

    def record(self, work: StepWork, seconds: float) -> None:
        """A step (or a forward) that did ``work`` took ``seconds``."""
        if seconds <= 0.0 or work.forwards + work.rows == 0:
            return
        x, lam = work.features(), self.forgetting
        for i in range(_FEATURES):
            self._moment[i] = lam * self._moment[i] + x[i] * seconds
            for j in range(_FEATURES):
                self._gram[i][j] = lam * self._gram[i][j] + x[i] * x[j]
        self._theta = self._solve()
        self.num_steps += 1

    def _solve(self) -> list[float]:
        """The non-negative least-squares rates: the best of the unconstrained fits on each
        subset of the counts whose rates all come out non-negative (three counts: seven
        subsets, exact)."""
        gram, moment = self._gram, self._moment
        a = [row[:] for row in gram]
        b = moment[:]
        for i in range(_FEATURES):  # the ridge toward the prior rates
            a[i][i] += _RIDGE * gram[i][i] + _TINY
            b[i] += (_RIDGE * gram[i][i] + _TINY) * self._prior[i]
        best, best_loss = [0.0] * _FEATURES, 0.0
        for mask in range(1, 1 << _FEATURES):
            idx = [i for i in range(_FEATURES) if mask >> i & 1]
            sol = _solve_scaled([[a[i][j] for j in idx] for i in idx], [b[i] for i in idx])
            if sol is None or min(sol) < 0.0:
                continue
            loss = -sum(v * b[i] for v, i in zip(sol, idx, strict=True))  # at the optimum
            if loss < best_loss:
                best_loss, best = loss, [0.0] * _FEATURES
                for v, i in zip(sol, idx, strict=True):
                    best[i] = v
        return best

    def predict(self, work: StepWork) -> float | None:
        """Predicted seconds of ``work``; None until ``min_steps`` steps were recorded."""
        if self.num_steps < self.min_steps:
            return None
        return sum(t * v for t, v in zip(self._theta, work.features(), strict=True))

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(seconds per forward, per row, per key-row), or None until it predicts."""
        if self.num_steps < self.min_steps:
            return None
        return tuple(self._theta)


# The ridge, as a share of each count's own weighted sum of squares, and a floor for a count
# no step had (its rate then stays the prior's).
_RIDGE = 1e-3
_TINY = 1e-30


def _solve_scaled(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``x`` with ``a x = b`` (symmetric positive definite ``a``), solved on the diagonally
    scaled system (the counts span nine orders of magnitude); None when singular."""
    n = len(b)
    d = [a[i][i] ** 0.5 for i in range(n)]
    if min(d) <= 0.0:
        return None
    m = [[a[i][j] / (d[i] * d[j]) for j in range(n)] + [b[i] / d[i]] for i in range(n)]
    for col in range(n):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    y = [0.0] * n
    for r in range(n - 1, -1, -1):
        y[r] = (m[r][n] - sum(m[r][c] * y[c] for c in range(r + 1, n))) / m[r][r]
    return [y[i] / d[i] for i in range(n)]
