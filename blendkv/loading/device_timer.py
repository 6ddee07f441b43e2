"""Compute time of prefill steps on a CUDA device, for the cost check (``cost_check``).

On CUDA the host only queues the work, so its clock says nothing about a step's compute. A
:class:`DeviceStepTimer` records an event on the compute stream where the step's forward starts
and another where it ends; the span between them is the step's time on the device, waits for the
host's launches included (a host-bound step is as slow as its launches). The events are read
later, without waiting: :meth:`collect` feeds the loading controller every finished span, and
leaves the rest for the next call. So the timer adds no host-device synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable

from blendkv.loading.controller import LoadingController

# Spans not yet read are dropped beyond this many (a step whose events never complete, e.g.
# after a failed forward, must not hold memory forever).
MAX_PENDING = 64


class DeviceStepTimer:
    """Event spans of prefill steps, read once the device has run them.

    ``event_factory`` makes a timing event (``torch.cuda.Event(enable_timing=True)`` by default)
    with ``record(stream)``, ``query()`` and ``elapsed_time(other)`` in milliseconds; ``stream``
    is the compute stream the forward runs on (default: the current stream of the event's
    device at record time).
    """

    def __init__(self, event_factory: Callable[[], object] | None = None) -> None:
        self._event_factory = event_factory
        self._pending: list[tuple[str, float, float, object, object]] = []

    def _event(self):
        if self._event_factory is not None:
            event = self._event_factory()
            event.record()
            return event
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream())
        return event

    def start(self):
        """An event at the forward's start (pass it to :meth:`stop`)."""
        return self._event()

    def stop(self, start, kind: str, row_layers: float, waited: float = 0.0) -> None:
        """The forward begun at ``start`` has been queued: ``kind`` "blend" (a fused prefill
        of ``row_layers``, of which ``waited`` seconds were stalls on chunk K/V writes) or
        "full" (plain prefill rows)."""
        assert kind in ("blend", "full"), kind
        self._pending.append((kind, row_layers, waited, start, self._event()))
        del self._pending[:-MAX_PENDING]

    def collect(self, controller: LoadingController) -> int:
        """Feed ``controller`` every span the device has finished; returns how many."""
        done = 0
        for kind, row_layers, waited, start, end in self._pending:
            if not end.query():  # later spans end later on the same stream
                break
            seconds = start.elapsed_time(end) / 1e3 - waited
            if kind == "blend":
                controller.record_compute(row_layers, seconds)
            else:
                controller.record_full_compute(row_layers, seconds)
            done += 1
        del self._pending[:done]
        return done

    @property
    def pending(self) -> int:
        return len(self._pending)
