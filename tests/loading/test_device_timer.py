"""The cost check's rates on CUDA come from event spans read without waiting
(``blendkv.loading.device_timer``). No CUDA here: a stand-in event with the same three methods
(record, query, elapsed_time) drives the timer's bookkeeping; tests/gpu runs it on real events."""

from __future__ import annotations

import pytest

from blendkv.loading.controller import LoadingController
from blendkv.loading.device_timer import MAX_PENDING, DeviceStepTimer


class _Clock:
    """A device clock: events record the time they are queued at, and complete when the
    device has reached them (``done_until``)."""

    def __init__(self) -> None:
        self.now = 0.0  # ms
        self.done_until = 0.0

    def event(self):
        clock = self

        class Event:
            at = None

            def record(self, stream=None):
                self.at = clock.now

            def query(self):
                return self.at <= clock.done_until

            def elapsed_time(self, other):
                assert self.query() and other.query(), "read before the device reached it"
                return other.at - self.at

        return Event()


def test_spans_feed_the_controller_only_once_the_device_ran_them():
    clock, controller = _Clock(), LoadingController()
    timer = DeviceStepTimer(clock.event)
    start = timer.start()
    clock.now = 20.0  # a plain prefill of 1,000 row-layers takes 20 ms on the device
    timer.stop(start, "full", 1000)
    start = timer.start()
    clock.now = 30.0  # a fused prefill of 400 row-layers, 2 ms of it stalled on K/V writes
    timer.stop(start, "blend", 400, waited=0.002)

    clock.done_until = 25.0  # the device is past the first span only
    assert timer.collect(controller) == 1
    assert controller.full_compute.value == pytest.approx(1000 / 0.020)
    assert controller.compute.value is None
    assert timer.pending == 1

    clock.done_until = 30.0
    assert timer.collect(controller) == 1
    assert controller.compute.value == pytest.approx(400 / 0.008)
    assert timer.pending == 0
    assert timer.collect(controller) == 0  # each span is counted once


def test_unread_spans_are_bounded():
    clock, controller = _Clock(), LoadingController()
    timer = DeviceStepTimer(clock.event)
    for _ in range(MAX_PENDING + 10):
        start = timer.start()
        clock.now += 1.0
        timer.stop(start, "full", 100)
    assert timer.pending == MAX_PENDING
    clock.done_until = clock.now
    assert timer.collect(controller) == MAX_PENDING
    assert controller.full_compute.value == pytest.approx(100 / 0.001)


def test_unknown_kind_is_an_invariant_error():
    clock = _Clock()
    timer = DeviceStepTimer(clock.event)
    with pytest.raises(AssertionError):
        timer.stop(timer.start(), "decode", 1)
