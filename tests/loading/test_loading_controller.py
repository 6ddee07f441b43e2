"""The loading controller's decisions, from injected measurements (no clock is read)."""

from __future__ import annotations

import pytest

from blendkv.loading.controller import LoadingController, RateEstimate

MB = 1 << 20


def controller(bandwidth: dict[str, float], row_layers_per_s: float | None) -> LoadingController:
    c = LoadingController()
    for tier, bytes_per_s in bandwidth.items():
        c.record_load(tier, int(bytes_per_s), 1.0)
    if row_layers_per_s is not None:
        c.record_compute(int(row_layers_per_s), 1.0)
    return c


def ratio(c: LoadingController, tier: str, layer_bytes: int = 4 * MB) -> float:
    return c.choose_ratio(0.15, 0.6, 5000, 100, {tier: layer_bytes})


def test_nothing_measured_gives_the_floor():
    assert ratio(LoadingController(), "lmdb") == 0.15
    assert ratio(controller({}, 1e6), "lmdb") == 0.15  # storage not measured yet
    assert ratio(controller({"lmdb": 1e9}, None), "lmdb") == 0.15  # compute not measured


def test_fast_storage_gives_the_floor():
    # 4 MB at 10 GB/s = 0.4 ms a layer; 1e6 row-layers/s hides 400 rows < 100 + 0.15 * 5000.
    assert ratio(controller({"memory": 10e9}, 1e6), "memory") == 0.15


def test_slow_storage_raises_the_ratio_while_it_stays_hidden():
    # 4 MB at 0.3 GB/s = 14 ms a layer: 14,000 rows of compute hide behind it -> capped at 0.6.
    assert ratio(controller({"redis": 0.3e9}, 1e6), "redis") == 0.6
    # 4 MB at 2 GB/s = 2.1 ms: 2,097 rows hidden - 100 others = 1,997 of 5,000 reused.
    r = ratio(controller({"lmdb": 2e9}, 1e6), "lmdb")
    assert r == pytest.approx((4 * MB / 2e9 * 1e6 - 100) / 5000)
    assert 0.15 < r < 0.6


def test_slower_compute_lowers_the_ratio():
    fast = ratio(controller({"lmdb": 2e9}, 1e6), "lmdb")
    slow = ratio(controller({"lmdb": 2e9}, 0.5e6), "lmdb")
    assert slow < fast


def test_loads_from_several_tiers_add_up():
    c = controller({"memory": 10e9, "lmdb": 2e9}, 1e6)
    both = c.choose_ratio(0.0, 1.0, 5000, 0, {"memory": 2 * MB, "lmdb": 2 * MB})
    assert both == pytest.approx((2 * MB / 10e9 + 2 * MB / 2e9) * 1e6 / 5000)


def test_running_estimates_follow_new_measurements():
    est = RateEstimate(alpha=0.5)
    est.update(100, 1.0)
    assert est.value == 100
    est.update(300, 1.0)
    assert est.value == 200
    est.update(5, 0.0)  # a zero-length measurement is ignored
    assert est.value == 200


def test_tier_choice():
    c = LoadingController()
    assert c.choose_tier(["lmdb", "memory"]) == "memory"  # unmeasured: fixed order
    c.record_load("memory", 1 * MB, 1.0)
    c.record_load("lmdb", 8 * MB, 1.0)
    assert c.choose_tier(["lmdb", "memory"]) == "lmdb"  # measured faster
    assert c.choose_tier(["redis"]) == "redis"


def test_load_that_does_not_overlap_compute_leaves_the_floor():
    """Recompute hides only behind what loads layer by layer during the forward: a serial step
    (``overlapped=False``) or a slow read made before the forward (``layerwise_seconds`` small)
    keeps the floor, while the tier choice still sees the whole load."""
    slow = controller({"redis": 0.3e9}, 1e6)
    assert slow.choose_ratio(0.15, 0.6, 5000, 100, {"redis": 4 * MB}, overlapped=False) == 0.15
    c = LoadingController()
    # 1 GB read from Redis in 3 s before the forward, written in 0.1 s behind it.
    c.record_load("redis", 1 << 30, 3.1, layerwise_seconds=0.1)
    c.record_load("memory", 1 << 30, 0.2, layerwise_seconds=0.1)
    c.record_compute(10**6, 1.0)
    assert ratio(c, "redis") == 0.15  # 4 MB at ~10.7 GB/s layer by layer hides ~390 rows
    assert c.choose_tier(["memory", "redis"]) == "memory"
    serial = LoadingController()
    serial.record_load("lmdb", 1 << 20, 1.0, layerwise_seconds=0.0)  # a serial step
    serial.record_compute(10**6, 1.0)
    assert ratio(serial, "lmdb") == 0.15  # nothing measured layer by layer yet
    assert serial.choose_tier(["lmdb"]) == "lmdb"


def test_seconds_per_chunk_load_by_tier():
    c = LoadingController()
    assert c.chunk_seconds("redis") is None  # nothing loaded yet
    c.record_load("redis", 4 * MB, 0.04)
    c.record_load("memory", 4 * MB, 0.01)
    assert c.chunk_seconds("redis") == pytest.approx(0.04)
    assert c.chunk_seconds("memory") == pytest.approx(0.01)
    c.record_load("redis", 4 * MB, 0.02)  # a moving average: partway to the new load's time
    assert 0.02 < c.chunk_seconds("redis") < 0.04
