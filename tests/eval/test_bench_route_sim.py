"""``blendkv bench route-sim``: a simulated replica reports its costs only as a live one could
have measured them, and every router runs on the simulated cluster (pure Python, no Ray)."""

from __future__ import annotations

import pytest

from blendkv.entrypoints.ray_serve.routing import POLICIES, ReplicaCosts
from blendkv.eval.bench.route_sim import DEFAULT_COSTS, _Replica, simulate
from blendkv.eval.zipf_workload import ZipfWorkload


def test_a_simulated_replica_reports_what_it_has_measured_by_the_tick():
    rep = _Replica("r0", capacity=8)
    rep.start(0.0, 2.0, [1, 2], misses=2)  # both chunks from the store
    rep.report(1.0, store_chunk_s=0.03)
    assert rep.costs == ReplicaCosts()  # nothing finished by the tick
    rep.report(2.0, store_chunk_s=0.03)
    assert rep.costs == ReplicaCosts(None, 2.0)  # no memory-tier read to compare with yet
    rep.start(2.5, 4.0, [1, 3], misses=1)
    rep.report(4.0, store_chunk_s=0.03)
    assert rep.costs.store_chunk_s == 0.03
    assert rep.costs.service_s == pytest.approx(2.0 + 0.3 * (1.5 - 2.0))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_router_runs_on_the_simulated_cluster(policy):
    workload = ZipfWorkload(
        num_documents=32, documents_per_request=4, topic_size=8, num_requests=60, rate=1.0
    )
    result = simulate(policy, 2, workload, DEFAULT_COSTS, 16, 2, 1.0)
    assert 0 <= result["memory_hit_rate"] <= 1
    assert result["ttft_p50_s"] >= DEFAULT_COSTS["base_s"]
