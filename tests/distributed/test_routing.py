"""The routing policies on injected replica summaries, costs and queue depths (pure Python, no
Ray): cost-aware picks the least expected wait (the prefill ahead, or without a measured time to
first token queue depth × service time, + chunks not held × store-load seconds); chunk
affinity the replica holding most of a request's chunks, within the queue-depth imbalance
bound, else the least loaded; the baselines do what their names say."""

from __future__ import annotations

import pytest
import torch

from blendkv.entrypoints.ray_serve.routing import (
    ChunkAffinity,
    CostAware,
    LeastLoaded,
    ReplicaCosts,
    ReplicaState,
    RoundRobin,
    SendLog,
    TierSummary,
    key_digest,
    make_policy,
    prefill_ahead,
)
from blendkv.store.memory_tier import MemoryTier


def key(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8  # 16 bytes, like a chunk key


def chunks(*ids: int) -> list[list[str]]:
    """A request's chunks: one candidate key each."""
    return [[key_digest(key(i))] for i in ids]


def replica(name: str, depth: int, memory=(), device=(), costs=None, ages=None) -> ReplicaState:
    summary = TierSummary.of(map(key, memory), map(key, device))
    return ReplicaState(name, depth, summary, costs, ages)


STORE_CHUNK_S = 0.031  # measured: a chunk from the store instead of the memory tier
SLOW = ReplicaCosts(store_chunk_s=STORE_CHUNK_S, service_s=2.5)  # a request takes 2.5 s


def test_cost_aware_follows_the_chunks_when_queues_are_equal():
    # The holder listed second: a policy blind to the chunks would take the first in turn.
    for depth in (0, 3):
        replicas = [replica("a", depth, costs=SLOW), replica("b", depth, [1, 2, 3], costs=SLOW)]
        decision = CostAware().choose(chunks(1, 2, 3), replicas)
        assert (decision.replica_id, decision.reason, decision.chunks_held) == ("b", "cost", 3)


def test_cost_aware_leaves_the_holder_when_its_queue_costs_more_than_the_loads():
    # b holds all 3 chunks but has one request ahead: 2.5 s of queue against 3 × 0.031 s of
    # store loads on the idle a.
    replicas = [replica("a", 0, costs=SLOW), replica("b", 1, [1, 2, 3], costs=SLOW)]
    assert CostAware().choose(chunks(1, 2, 3), replicas).replica_id == "a"
    # The same queue on replicas that serve a request in 0.05 s: 0.05 s < 0.093 s of loads.
    fast = ReplicaCosts(store_chunk_s=STORE_CHUNK_S, service_s=0.05)
    replicas = [replica("a", 0, costs=fast), replica("b", 1, [1, 2, 3], costs=fast)]
    assert CostAware().choose(chunks(1, 2, 3), replicas).replica_id == "b"


def test_cost_aware_breaks_equal_waits_by_queue_then_in_turn():
    # a: one request of 0.1 s ahead, every chunk held; b: idle, one chunk of 0.1 s to load.
    costs = ReplicaCosts(store_chunk_s=0.1, service_s=0.1)
    replicas = [replica("a", 1, [1], costs=costs), replica("b", 0, costs=costs)]
    assert CostAware().choose(chunks(1), replicas).replica_id == "b"
    # Equal waits and queues: each in turn.
    replicas = [replica("a", 0, costs=costs), replica("b", 0, costs=costs)]
    policy = CostAware()
    assert [policy.choose(chunks(1), replicas).replica_id for _ in range(4)] == list("abab")


def test_cost_aware_counts_only_the_prefill_ahead_when_the_requests_ages_are_known():
    # Both replicas hold 2 requests. a's were sent just now (still prefilling: 0.2 s each
    # left); b's 1 s ago (decoding beside a new one: nothing ahead). Queue depth alone ties.
    costs = ReplicaCosts(store_chunk_s=0.01, service_s=0.4, prefill_s=0.2)
    replicas = [
        replica("a", 2, costs=costs, ages=(0.0, 0.0)),
        replica("b", 2, costs=costs, ages=(1.0, 1.0)),
    ]
    assert CostAware().choose(chunks(1), replicas).replica_id == "b"
    # Requests arriving together no longer go together: after two ended on b, the first goes
    # to the idle b, the second to a, whose two requests are decoding, not to b again.
    log, policy, now = SendLog(), CostAware(), 10.0
    log.sent("a", 9.0)
    log.sent("a", 9.0)
    depth = {"a": 2, "b": 0}
    picked = []
    for _ in range(2):
        states = [replica(r, depth[r], costs=costs, ages=log.ages(r, depth[r], now)) for r in "ab"]
        choice = policy.choose(chunks(1), states).replica_id
        log.sent(choice, now)
        depth[choice] += 1
        picked.append(choice)
    assert picked == ["b", "a"]
    # Without ages (the simulation) queue depth × service time stands in: both to b.
    depth = {"a": 2, "b": 0}
    picked = []
    for _ in range(2):
        states = [replica(r, depth[r], costs=costs) for r in "ab"]
        choice = policy.choose(chunks(1), states).replica_id
        depth[choice] += 1
        picked.append(choice)
    assert picked == ["b", "b"]


def test_the_send_log_keeps_the_newest_sends_a_replica_still_holds():
    log = SendLog()
    assert log.ages("a", 3, 5.0) == ()
    for t in (1.0, 2.0, 3.0):
        log.sent("a", t)
    assert log.ages("a", 3, 5.0) == (2.0, 3.0, 4.0)  # newest first
    assert log.ages("a", 1, 5.0) == (2.0,)  # two ended: the oldest are forgotten
    assert log.ages("a", 3, 6.0) == (3.0,)  # a request another router sent is not in it
    assert prefill_ahead((0.05, 0.3, 2.0), prefill_s=0.25) == pytest.approx(0.2)


def test_cost_aware_without_measurements():
    # Nobody measured: chunk affinity decides (b holds the chunks, within the bound of 2),
    # where the costs, once measured, send the request to the idle a.
    unmeasured = [replica("a", 0), replica("b", 1, [1, 2, 3])]
    decision = CostAware(imbalance=2).choose(chunks(1, 2, 3), unmeasured)
    assert (decision.replica_id, decision.reason) == ("b", "affinity")
    half = [replica("a", 0), replica("b", 1, [1, 2, 3], costs=ReplicaCosts(service_s=2.5))]
    assert CostAware().choose(chunks(1, 2, 3), half).reason == "affinity"
    # b has not measured yet: it is given a's costs. a: idle, 3 chunks × 1 s to load = 3 s.
    for service_s, expected in ((2.0, "b"), (4.0, "a")):
        a = ReplicaCosts(store_chunk_s=1.0, service_s=service_s)
        replicas = [replica("a", 0, costs=a), replica("b", 1, [1, 2, 3])]
        decision = CostAware().choose(chunks(1, 2, 3), replicas)
        assert (decision.replica_id, decision.reason) == (expected, "cost")


def test_replica_costs_round_trip_and_reject_bad_numbers():
    costs = ReplicaCosts(store_chunk_s=0.031, service_s=1.8, prefill_s=0.2)
    assert ReplicaCosts.from_dict(costs.to_dict()) == costs
    assert ReplicaCosts.from_dict(None) == ReplicaCosts()
    bad = {"store_chunk_s": -1.0, "service_s": float("nan"), "prefill_s": "x"}
    assert ReplicaCosts.from_dict(bad) == ReplicaCosts()


def test_affinity_picks_the_replica_holding_most_chunks():
    replicas = [
        replica("a", 0, memory=[1]),
        replica("b", 1, memory=[1, 2, 3]),
        replica("c", 0, memory=[4]),
    ]
    decision = ChunkAffinity(imbalance=2).choose(chunks(1, 2, 3), replicas)
    assert (decision.replica_id, decision.reason, decision.chunks_held) == ("b", "affinity", 3)


def test_affinity_prefers_the_device_tier_then_the_shorter_queue():
    on_device = [replica("a", 0, memory=[1, 2]), replica("b", 0, memory=[1], device=[2])]
    assert ChunkAffinity().choose(chunks(1, 2), on_device).replica_id == "b"
    shorter = [replica("a", 2, memory=[1, 2]), replica("b", 1, memory=[1, 2])]
    assert ChunkAffinity().choose(chunks(1, 2), shorter).replica_id == "b"


def test_affinity_respects_the_imbalance_bound():
    # b holds every chunk but holds 3 more requests than a: past a bound of 2, not past 3.
    replicas = [replica("a", 0, memory=[1]), replica("b", 3, memory=[1, 2, 3])]
    assert ChunkAffinity(imbalance=2).choose(chunks(1, 2, 3), replicas).replica_id == "a"
    assert ChunkAffinity(imbalance=3).choose(chunks(1, 2, 3), replicas).replica_id == "b"
    # Within the bound nothing is held: the least loaded one.
    replicas = [replica("a", 1), replica("b", 5, memory=[1, 2, 3]), replica("c", 0)]
    decision = ChunkAffinity(imbalance=2).choose(chunks(1, 2, 3), replicas)
    assert (decision.replica_id, decision.reason) == ("c", "least_loaded")


def test_affinity_falls_back_to_the_least_loaded():
    # No overlap, no chunks, no summary yet: the least loaded (ties in turn).
    replicas = [replica("a", 1, memory=[7]), replica("b", 0), ReplicaState("c", 0, None)]
    policy = ChunkAffinity()
    picked = [policy.choose(chunks(1), replicas).replica_id for _ in range(4)]
    assert picked == ["b", "c", "b", "c"]
    assert policy.choose([], replicas).reason == "least_loaded"


def test_a_chunk_found_under_any_of_its_candidate_keys_counts():
    # A document sent in a request: stored under the store's anchor or the query-time one.
    request = [[key_digest(key(1)), key_digest(key(9))], [key_digest(key(2))]]
    replicas = [replica("a", 0, memory=[2]), replica("b", 0, memory=[9, 2])]
    decision = ChunkAffinity().choose(request, replicas)
    assert (decision.replica_id, decision.chunks_held) == ("b", 2)


def test_baselines_ignore_what_replicas_hold():
    replicas = [replica("a", 3, memory=[1]), replica("b", 1), replica("c", 2)]
    rr = RoundRobin()
    assert [rr.choose(chunks(1), replicas).replica_id for _ in range(4)] == ["a", "b", "c", "a"]
    ll = LeastLoaded()
    assert {ll.choose(chunks(1), replicas).replica_id for _ in range(3)} == {"b"}


def test_policies_by_name_and_bad_options():
    assert isinstance(make_policy("chunk-affinity", 4), ChunkAffinity)
    assert make_policy("chunk-affinity", 4).imbalance == 4
    assert isinstance(make_policy("round-robin"), RoundRobin)
    assert make_policy("cost-aware", 4).unmeasured.imbalance == 4
    with pytest.raises(ValueError, match="routing policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="imbalance"):
        ChunkAffinity(-1)
    with pytest.raises(ValueError, match="no replica"):
        LeastLoaded().choose([], [])


def test_summary_round_trips_and_follows_the_memory_tier():
    tier = MemoryTier(3 * 64)
    before = tier.generation
    for i in range(4):  # the fourth evicts the first
        tier.put(key(i), torch.zeros(16))
    generation, keys = tier.keys_at()
    assert generation > before and keys == [key(1), key(2), key(3)]
    summary = TierSummary.of(keys, [key(3)], generation)
    assert TierSummary.from_dict(summary.to_dict()) == summary
    assert summary.held(chunks(0, 1, 3)) == (2, 1)
    tier.get(key(2))  # a hit changes the order, not the set: the summary stands
    assert tier.generation == generation
    tier.discard(key(2))
    assert tier.generation == generation + 1
