"""A replica's service time (busy seconds per finished request) and the store-load seconds it
reports, from injected times and loads (no engine runs, no Ray)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from blendkv.connector.blend_connector import BlendConnector
from blendkv.entrypoints.ray_serve.replica import BlendKVReplica, ForwardedRequest
from blendkv.entrypoints.ray_serve.service_clock import ServiceClock, ServiceClockError
from blendkv.loading.controller import LoadingController


def test_one_request_at_a_time_gives_each_ones_service_time():
    clock = ServiceClock(alpha=1.0)  # the last sample alone
    assert clock.service_s is None
    clock.started(10.0)
    clock.finished(12.0)
    assert clock.service_s == 2.0
    clock.started(50.0)  # the 38 s idle in between never counts
    clock.finished(53.0)
    assert clock.service_s == 3.0


def test_a_queue_is_sampled_finish_to_finish():
    # Three requests arrive while the first runs and are served one after another, 2 s each.
    clock = ServiceClock(alpha=0.5)
    for arrival in (0.0, 0.5, 1.0):
        clock.started(arrival)
    for end in (2.0, 4.0, 6.0):
        clock.finished(end)
    assert clock.service_s == 2.0 and clock.active == 0


def test_a_batch_that_ends_at_once_averages_to_its_time_per_request():
    clock = ServiceClock(alpha=0.5)
    for _ in range(2):
        clock.started(0.0)
    clock.finished(4.0)
    clock.finished(4.0)  # 4 s, then 0 s: 2 s a request at this weight
    assert clock.service_s == 2.0


def test_a_finish_without_a_start_is_an_error():
    with pytest.raises(ServiceClockError):
        ServiceClock().finished(1.0)


def test_store_chunk_seconds_is_the_store_loads_excess_over_the_memory_tiers():
    controller = LoadingController(alpha=1.0)
    connector = SimpleNamespace(
        controller=controller, manager=SimpleNamespace(store=SimpleNamespace(tier="redis"))
    )
    saving = BlendConnector.store_chunk_seconds
    assert saving(connector) is None  # nothing measured
    controller.record_load("redis", 1 << 20, 0.040)
    assert saving(connector) is None  # no memory-tier load yet
    controller.record_load("memory", 1 << 20, 0.009)
    assert saving(connector) == pytest.approx(0.031)
    controller.record_load("memory", 1 << 20, 0.050)  # slower than the store: no saving
    assert saving(connector) == 0.0


def test_a_replica_times_its_post_requests_only():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    replica = object.__new__(BlendKVReplica)  # no Ray, no engine: the app above
    replica.app, replica._running, replica._clock = app, set(), ServiceClock()

    async def serve(method: str) -> list:
        request = ForwardedRequest(method, "/v1/chat/completions", b"", (), b"{}")
        return [item async for item in replica.forward(request)]

    assert asyncio.run(serve("GET"))[-1] == b"ok"
    assert replica._clock.service_s is None
    asyncio.run(serve("POST"))
    assert replica._clock.service_s is not None and replica._clock.active == 0
