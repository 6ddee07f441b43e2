"""``blendkv bench replicas``' table from its per-request rows (pure Python, no Ray): a prompt
served whole from the prefix cache is not a store miss, rounds pool, and p50 is compared with
round-robin's on the same requests."""

from __future__ import annotations

from blendkv.eval.bench.replicas import _summary


def _row(ttft, *, hit=4, in_memory=0, missed=0, prefix_cached=0, replica="a"):
    return {
        "ok": True,
        "ttft": ttft,
        "replica": replica,
        "num_chunks": 4,
        "hit": hit,
        "in_memory": in_memory,
        "on_device": 0,
        "missed": missed,
        "prefix_cached": prefix_cached,
    }


def test_a_prompt_found_in_the_prefix_cache_is_not_a_store_miss():
    rows = [_row(0.2, in_memory=2), _row(0.05, hit=0, prefix_cached=700)]
    out = _summary([{"rows": rows, "wall_s": 1.0}], None)
    assert out["store_misses"] == 0
    assert out["prefix_cached"] == 1
    assert out["store_reads"] == 2  # the first request's two chunks not in memory
    assert out["memory_hit_rate"] == 2 / 8

    rows.append(_row(0.3, hit=3, missed=1))  # one chunk computed at query time
    assert _summary([{"rows": rows, "wall_s": 1.0}], None)["store_misses"] == 1


def test_rounds_pool_and_p50_is_paired_with_round_robin():
    base = [{"rows": [_row(t) for t in (0.20, 0.30, 0.40, 0.50, 0.60)], "wall_s": 2.0}] * 2
    faster = [{"rows": [_row(t * 0.5) for t in (0.20, 0.30, 0.40, 0.50, 0.60)], "wall_s": 2.0}] * 2
    out = _summary(faster, base)
    assert out["requests"] == 10 and out["rounds"] == 2
    assert out["throughput_rps"] == 10 / 4.0
    vs = out["p50_vs_round_robin"]
    assert vs["ratio"] == 0.5
    assert vs["low"] <= 0.5 <= vs["high"] and vs["high"] < 1.0  # every pair halved

    same = _summary(base, base)["p50_vs_round_robin"]
    assert same == {"ratio": 1.0, "low": 1.0, "high": 1.0}
