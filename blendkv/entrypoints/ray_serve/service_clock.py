"""A replica's service time: its busy seconds per finished request, a moving average.

    a request starts ─▶ started(now)           finished(now) ◀─ a request ends
    sample = now − the later of (the last finish, when the replica last became busy)

Only busy time is sampled, never idle time. With one request at a time a sample is that
request's service time; with a batch, the time between finishes (a batch of n that ends at once
gives one long sample and n − 1 of zero), so the mean is busy seconds per request either way and
queue depth × service time is the wait behind the requests a replica holds. Times are passed in:
no clock is read here.
"""

from __future__ import annotations

from blendkv.loading.controller import MeanEstimate


class ServiceClockError(RuntimeError):
    """A request finished that the clock never saw start."""


class ServiceClock:
    """See the module docstring. ``alpha``: the moving average's weight of a new sample."""

    def __init__(self, alpha: float = 0.3) -> None:
        self._estimate = MeanEstimate(alpha)
        self._active = 0
        self._since = 0.0

    @property
    def service_s(self) -> float | None:
        """Busy seconds per finished request; None until a request finished."""
        return self._estimate.value

    @property
    def active(self) -> int:
        """Requests started and not finished."""
        return self._active

    def started(self, now: float) -> None:
        if self._active == 0:
            self._since = now
        self._active += 1

    def finished(self, now: float) -> None:
        if self._active == 0:
            raise ServiceClockError("a request finished that never started")
        self._estimate.update(max(0.0, now - self._since))
        self._since = now
        self._active -= 1
