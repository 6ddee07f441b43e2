"""Routing simulated to 64 replicas: the same policies as the Ray Serve router, replicas modelled
with the per-tier costs ``blendkv bench replicas`` measured.

``blendkv bench route-sim [--costs bench_out/replicas.json] [--replicas 2,4,8,16,32,64]``

What runs is the routers' own code (:mod:`blendkv.entrypoints.ray_serve.routing`: the policy
objects, :class:`TierSummary` reports, queue depths); what is modelled is each replica:

* its memory tier, an LRU of ``--memory-tier-chunks`` chunks: a request's chunks are read from
  it (hit) or from the shared store (miss) and then held;
* its service, one request at a time in arrival order (a CPU replica; a GPU one batches, which
  this model does not): time to first token = the wait + ``base_s`` + ``store_chunk_s`` per
  chunk read from the store; then ``decode_s`` before the next request starts;
* its report, a :class:`TierSummary` of the requests finished by the last report tick (every
  ``--stats-period`` seconds, as Ray Serve polls ``record_routing_stats``), never fresher, and
  its :class:`ReplicaCosts` as a live replica measures them: busy seconds per finished request
  from the same :class:`ServiceClock`, and ``store_chunk_s`` (a memory-tier read costs nothing
  here) once it has finished a request with a store read and one with a memory-tier hit.

The corpus grows with the cluster (``--documents-per-replica``), requests follow the Zipf
popularity of :mod:`blendkv.eval.zipf_workload` and arrive as a Poisson process at ``--load``
times what the replicas could serve if every chunk came from the store.

Ingest is modelled beside it: N workers each computing chunks at the per-worker rate the live
ingest measured, all writing into one Redis at its measured seconds per chunk write, so the
store's single thread caps the aggregate (``min(N * rate, 1 / write_s)``).
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from blendkv.entrypoints.ray_serve.routing import (
    POLICIES,
    ReplicaCosts,
    ReplicaState,
    TierSummary,
    key_digest,
    make_policy,
)
from blendkv.entrypoints.ray_serve.service_clock import ServiceClock
from blendkv.eval.zipf_workload import ZipfWorkload

# Measured by `blendkv bench replicas` (docs/benchmarks.md: SmolLM2-135M float32, one core per
# replica, 4 passages of ~190 tokens per request); --costs reads a newer run's JSON.
DEFAULT_COSTS = {
    "base_s": 1.0,
    "store_chunk_s": 0.05,
    "decode_s": 0.5,
    "ingest_chunks_per_s": 5.0,
    "store_write_s": 0.02,
}


@dataclass
class _Replica:
    rid: str
    capacity: int
    lru: OrderedDict = field(default_factory=OrderedDict)  # as of its last assigned request
    finishing: deque = field(default_factory=deque)  # finish times of the requests it holds
    free_at: float = 0.0
    pending: deque = field(default_factory=deque)  # (finish, chunks, misses) not yet reported
    reported: OrderedDict = field(default_factory=OrderedDict)  # the LRU as last reported
    summary: TierSummary = field(default_factory=TierSummary)
    generation: int = 0
    clock: ServiceClock = field(default_factory=ServiceClock)
    loads: set = field(default_factory=set)  # the tiers it has finished a load from, by a tick
    costs: ReplicaCosts = field(default_factory=ReplicaCosts)  # as last reported

    def depth(self, now: float) -> int:
        """Requests held at ``now`` (call with times that never go back)."""
        while self.finishing and self.finishing[0] <= now:
            self.clock.finished(self.finishing.popleft())
        return len(self.finishing)

    def start(self, now: float, finish: float, chunks, misses: int) -> None:
        """A request arriving at ``now`` that will finish at ``finish``."""
        self.clock.started(now)
        self.free_at = finish
        self.finishing.append(finish)
        self.pending.append((finish, chunks, misses))

    def touch(self, lru: OrderedDict, chunks) -> int:
        """Read ``chunks`` through ``lru`` (an LRU of ``capacity``); returns the misses."""
        misses = 0
        for c in chunks:
            if c in lru:
                lru.move_to_end(c)
            else:
                misses += 1
                lru[c] = None
                while len(lru) > self.capacity:
                    lru.popitem(last=False)
        return misses

    def report(self, tick: float, store_chunk_s: float) -> None:
        """The summary and costs Ray Serve would hold after the poll at ``tick``."""
        changed = False
        self.depth(tick)
        while self.pending and self.pending[0][0] <= tick:
            _, chunks, misses = self.pending.popleft()
            self.touch(self.reported, chunks)
            self.loads.update(("store",) if misses else ())
            self.loads.update(("memory",) if misses < len(chunks) else ())
            changed = True
        measured = store_chunk_s if len(self.loads) == 2 else None
        self.costs = ReplicaCosts(measured, self.clock.service_s)
        if changed:
            self.generation += 1
            keys = [_key(c) for c in self.reported]
            self.summary = TierSummary.of(keys, (), self.generation)


def _key(doc: int) -> bytes:
    return doc.to_bytes(16, "little")  # distinct in the digest's first bytes


def simulate(
    policy_name: str,
    replicas: int,
    workload: ZipfWorkload,
    costs: dict,
    memory_tier_chunks: int,
    imbalance: int,
    stats_period: float,
) -> dict:
    """One policy on ``replicas`` simulated replicas: memory-tier hit rate, TTFT p50/p99,
    throughput (requests per second of simulated time)."""
    policy = make_policy(policy_name, imbalance)
    pool = [_Replica(f"r{i}", memory_tier_chunks) for i in range(replicas)]
    digests = {}
    hits = chunks = 0
    ttfts: list[float] = []
    next_tick, last_finish = stats_period, 0.0
    requests = workload.requests()
    for r in requests:
        t = r.arrival_s
        while next_tick <= t:
            for rep in pool:
                rep.report(next_tick, costs["store_chunk_s"])
            next_tick += stats_period
        want = [[digests.setdefault(d, key_digest(_key(d)))] for d in r.documents]
        states = [ReplicaState(rep.rid, rep.depth(t), rep.summary, rep.costs) for rep in pool]
        chosen = pool[int(policy.choose(want, states).replica_id[1:])]
        misses = chosen.touch(chosen.lru, r.documents)
        hits += len(r.documents) - misses
        chunks += len(r.documents)
        start = max(t, chosen.free_at)
        first_token = start + costs["base_s"] + misses * costs["store_chunk_s"]
        finish = first_token + costs["decode_s"]
        chosen.start(t, finish, r.documents, misses)
        ttfts.append(first_token - t)
        last_finish = max(last_finish, finish)
    ttfts.sort()
    return {
        "memory_hit_rate": round(hits / chunks, 4),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3),
        "throughput_rps": round(len(requests) / (last_finish - requests[0].arrival_s), 3),
    }


def ingest_scaling(costs: dict, workers: list[int]) -> list[dict]:
    rate, write_s = costs["ingest_chunks_per_s"], costs["store_write_s"]
    cap = 1.0 / write_s if write_s > 0 else float("inf")
    return [
        {"workers": n, "chunks_per_s": round(min(n * rate, cap), 1), "store_bound": n * rate > cap}
        for n in workers
    ]


def load_costs(path: str | None) -> tuple[dict, str]:
    """Per-tier costs: from ``bench replicas --json`` output, else :data:`DEFAULT_COSTS`."""
    if path is None:
        return dict(DEFAULT_COSTS), "defaults (docs/benchmarks.md)"
    run = json.loads(Path(path).read_text())
    tiers = run["tiers"]
    workers = run["ingest"]["workers"]
    costs = {
        "base_s": tiers["base_s"],
        "store_chunk_s": tiers["store_chunk_s"],
        "decode_s": tiers["decode_s"],
        "ingest_chunks_per_s": sum(w["chunks_per_s"] for w in workers) / len(workers),
        "store_write_s": tiers["store_write_s"],
    }
    return costs, f"{path} ({run.get('commit', '?')}, {run.get('machine', '?')})"


def main(args: argparse.Namespace) -> int:
    costs, source = load_costs(args.costs)
    print(f"costs from {source}: {json.dumps(costs)}")
    n = args.per_request
    worst = costs["base_s"] + n * costs["store_chunk_s"] + costs["decode_s"]
    rows = []
    for replicas in args.replicas:
        workload = ZipfWorkload(
            num_documents=args.documents_per_replica * replicas,
            documents_per_request=n,
            topic_size=args.topic_size,
            zipf_s=args.zipf_s,
            num_requests=args.requests_per_replica * replicas,
            rate=args.load * replicas / worst,
            seed=args.seed,
        )
        for policy in args.policies:
            result = simulate(
                policy,
                replicas,
                workload,
                costs,
                args.memory_tier_chunks,
                args.imbalance,
                args.stats_period,
            )
            rows.append({"replicas": replicas, "policy": policy, **result})
            print(json.dumps(rows[-1]), flush=True)
    ingest = ingest_scaling(costs, args.ingest_workers)
    _print(rows, ingest)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"costs": costs, "source": source, "routing": rows, "ingest": ingest}, indent=1
            )
        )
    return 0


def _print(rows: list[dict], ingest: list[dict]) -> None:
    print("\n| replicas | router | memory-tier hit rate | TTFT p50 (s) | TTFT p99 (s) | req/s |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['replicas']} | {r['policy']} | {r['memory_hit_rate']:.2f} | {r['ttft_p50_s']} "
            f"| {r['ttft_p99_s']} | {r['throughput_rps']} |"
        )
    print("\n| ingest workers | chunks/s | bound by |")
    print("|---:|---:|---|")
    for r in ingest:
        bound = "the store's writes" if r["store_bound"] else "the workers"
        print(f"| {r['workers']} | {r['chunks_per_s']} | {bound} |")


def policies_arg(text: str) -> list[str]:
    names = text.split(",")
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise argparse.ArgumentTypeError(f"routers are {', '.join(POLICIES)}; got {bad}")
    return names


def ints_arg(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]
