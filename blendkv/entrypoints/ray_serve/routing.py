"""Which replica serves a request: the one where it is expected to wait least for its first
token, counting both the queue ahead of it and the chunks it would load from the shared store.

    a request's chunks ─▶ chunk keys ─▶ digests ─────────┐
    each replica's report: TierSummary (its tiers' keys)  │
                    and ReplicaCosts (what it measured)    ├─▶ policy.choose ─▶ RoutingDecision
    each replica's queue depth (requests it holds) ───────┘

Every router in the field scores replicas by the *prefix* a request shares with what they
cached. A blend engine reuses chunks wherever they sit in the prompt, so what decides whether a
request loads its chunks from host (or device) memory or from the shared store is the overlap
of its *chunk set* with what a replica's tiers hold. How much that overlap is worth is measured,
not assumed: :class:`CostAware` sends a request to the replica minimising

    expected wait = prefill ahead + chunks its tiers do not hold × store_chunk_s

``store_chunk_s`` is the seconds a chunk costs more loaded from the shared store than from the
replica's memory tier. *Prefill ahead* is the prefill a new request would wait behind: the
replica's requests that have not reached their first token, each for what is left of the
replica's ``prefill_s`` (its mean time to first token) since the router sent it
(:class:`SendLog`). A replica batches continuously, so a request past its first token only
decodes beside a new one and does not hold it back. Counting every held request the same sends
requests that arrive together (after a batch that ended together) to the same replica, where
they prefill together, end together, and arrive together again. Without ``prefill_s``,
``queue depth × service_s`` (busy seconds per finished request) stands in. All three are
moving averages the replica measured (:class:`ReplicaCosts`). Equal waits go to the shorter
queue, then in turn. A replica that has not measured one of them yet is given the mean of the
replicas that have (same model, same store); while no replica has, :class:`ChunkAffinity`
decides. :class:`ChunkAffinity` sends a request to the replica holding most of its chunks,
among the replicas whose queue depth is within ``imbalance`` of the least loaded one; when none
of those holds any, to the least loaded. :class:`RoundRobin` and :class:`LeastLoaded` are the
baselines (Ray Serve's default, power of two choices, is least loaded among two at random).

Pure Python, no Ray: the Ray Serve request router (:mod:`.router`) and the simulation to 64
replicas (``blendkv bench route-sim``) run this same code. A replica reports a
:class:`TierSummary` (the digests of the keys its tiers hold, rebuilt only when the tiers'
generation moved) and its :class:`ReplicaCosts`, so the router never asks a replica anything
per request.

A chunk may have more than one key a replica could hold it under (a document sent in a request
is found under the store's anchor when it was ingested, else under the query-time anchor), so a
request's chunks are given as, per chunk, the digests of its candidate keys.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DIGEST_BYTES = 8  # of a chunk key (xxh3-128): a collision only misroutes, it never corrupts
DEFAULT_IMBALANCE = 2  # queue depth over the least loaded replica's that affinity may add


def key_digest(key: bytes) -> str:
    """The short form of a chunk key that summaries and requests carry (hex)."""
    return key[:DIGEST_BYTES].hex()


@dataclass(frozen=True)
class TierSummary:
    """What one replica's tiers hold: the digests of the chunk keys in its host-memory tier and
    in its device tier, at ``generation`` (the tiers' change count)."""

    memory: frozenset[str] = frozenset()
    device: frozenset[str] = frozenset()
    generation: int = 0

    @classmethod
    def of(
        cls, memory: Iterable[bytes], device: Iterable[bytes] = (), generation: int = 0
    ) -> TierSummary:
        """The summary of tiers holding the chunk keys ``memory`` and ``device``."""
        return cls(
            frozenset(map(key_digest, memory)), frozenset(map(key_digest, device)), generation
        )

    def held(self, chunks: Sequence[Sequence[str]]) -> tuple[int, int]:
        """``(chunks held in any tier, of which on the device)`` of a request's chunks (per
        chunk, the digests of its candidate keys)."""
        held = on_device = 0
        for candidates in chunks:
            if any(d in self.device for d in candidates):
                held += 1
                on_device += 1
            elif any(d in self.memory for d in candidates):
                held += 1
        return held, on_device

    def to_dict(self) -> dict:
        """A JSON-able form (what a replica returns to Ray Serve's routing stats)."""
        return {
            "memory": sorted(self.memory),
            "device": sorted(self.device),
            "generation": self.generation,
        }

    @classmethod
    def from_dict(cls, d: dict | None) -> TierSummary:
        if not d:
            return cls()
        return cls(frozenset(d["memory"]), frozenset(d["device"]), int(d["generation"]))


@dataclass(frozen=True)
class ReplicaCosts:
    """What one replica measured (moving averages; None: not measured yet): ``store_chunk_s``,
    the seconds a chunk costs more loaded from the shared store than from its memory tier,
    ``service_s``, its busy seconds per finished request, and ``prefill_s``, its requests' time
    to first token."""

    store_chunk_s: float | None = None
    service_s: float | None = None
    prefill_s: float | None = None

    def to_dict(self) -> dict:
        return {
            "store_chunk_s": self.store_chunk_s,
            "service_s": self.service_s,
            "prefill_s": self.prefill_s,
        }

    @classmethod
    def from_dict(cls, d: dict | None) -> ReplicaCosts:
        if not d:
            return cls()
        return cls(
            _seconds(d.get("store_chunk_s")),
            _seconds(d.get("service_s")),
            _seconds(d.get("prefill_s")),
        )


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows of one replica: its id, how many requests it holds now (running
    and queued), its last reported summary and costs (None: none reported yet), and the ages of
    the requests it holds, newest first (seconds since the router sent them; None: not
    tracked, as in the simulation)."""

    replica_id: str
    queue_depth: int
    summary: TierSummary | None = None
    costs: ReplicaCosts | None = None
    ages: tuple[float, ...] | None = None


@dataclass(frozen=True)
class RoutingDecision:
    """The replica chosen, why (``"cost"``: least expected wait; ``"affinity"``: most chunks
    held within the bound; ``"least_loaded"``: none of the replicas in the bound holds any;
    ``"round_robin"``), and how many of the request's chunks its tiers hold."""

    replica_id: str
    reason: str
    chunks_held: int = 0


class RoutingPolicy(ABC):
    """Picks one replica for a request. Stateful policies (a round-robin counter) keep their
    state on the instance: one instance per router."""

    name: str

    @abstractmethod
    def choose(
        self, chunks: Sequence[Sequence[str]], replicas: Sequence[ReplicaState]
    ) -> RoutingDecision:
        """The replica for a request whose chunks have the candidate digests ``chunks`` (empty:
        a request without chunks) among ``replicas`` (non-empty, in a stable order)."""


class RoundRobin(RoutingPolicy):
    """Each replica in turn, whatever it holds or has queued."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, chunks, replicas) -> RoutingDecision:
        _check(replicas)
        r = replicas[next(self._turn) % len(replicas)]
        return RoutingDecision(r.replica_id, "round_robin", _held(r, chunks))


class LeastLoaded(RoutingPolicy):
    """The replica with the fewest requests; ties taken in turn (so that an idle cluster still
    spreads its requests)."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, chunks, replicas) -> RoutingDecision:
        _check(replicas)
        r = self._least_loaded(replicas)
        return RoutingDecision(r.replica_id, "least_loaded", _held(r, chunks))

    def _least_loaded(self, replicas: Sequence[ReplicaState]) -> ReplicaState:
        low = min(r.queue_depth for r in replicas)
        tied = [r for r in replicas if r.queue_depth == low]
        return tied[next(self._turn) % len(tied)]


class ChunkAffinity(LeastLoaded):
    """Most chunks held, bounded: only replicas whose queue depth is at most ``imbalance``
    above the least loaded one's are considered; among them the one whose tiers hold most of
    the request's chunks (more of them on the device, then a shorter queue, break ties). When
    none of them holds any, the least loaded replica."""

    name = "chunk-affinity"

    def __init__(self, imbalance: int = DEFAULT_IMBALANCE) -> None:
        super().__init__()
        if isinstance(imbalance, bool) or not isinstance(imbalance, int) or imbalance < 0:
            raise ValueError(f"imbalance must be an integer >= 0, got {imbalance!r}")
        self.imbalance = imbalance

    def choose(self, chunks, replicas) -> RoutingDecision:
        _check(replicas)
        low = min(r.queue_depth for r in replicas)
        best, best_score = None, (0, 0, 0)
        for r in replicas:
            if r.queue_depth > low + self.imbalance or r.summary is None:
                continue
            held, on_device = r.summary.held(chunks)
            score = (held, on_device, -r.queue_depth)
            if held and (best is None or score > best_score):
                best, best_score = r, score
        if best is None:
            r = self._least_loaded(replicas)
            return RoutingDecision(r.replica_id, "least_loaded", _held(r, chunks))
        return RoutingDecision(best.replica_id, "affinity", best_score[0])


class CostAware(LeastLoaded):
    """Least expected wait (the formula in the module docstring); equal waits to the shorter
    queue, then in turn. Until some replica has measured both costs, :class:`ChunkAffinity`
    with ``imbalance`` decides."""

    name = "cost-aware"

    def __init__(self, imbalance: int = DEFAULT_IMBALANCE) -> None:
        super().__init__()
        self.unmeasured = ChunkAffinity(imbalance)

    def choose(self, chunks, replicas) -> RoutingDecision:
        _check(replicas)
        costs = _filled_costs(replicas)
        if costs is None:
            return self.unmeasured.choose(chunks, replicas)
        waits = [_expected_wait(r, c, chunks) for r, c in zip(replicas, costs, strict=True)]
        best = min(waits)
        tied = [r for r, w in zip(replicas, waits, strict=True) if w == best]
        r = tied[next(self._turn) % len(tied)]
        return RoutingDecision(r.replica_id, "cost", _held(r, chunks))


def prefill_ahead(ages: Sequence[float], prefill_s: float) -> float:
    """Seconds of prefill a new request waits behind on a replica whose held requests were sent
    ``ages`` seconds ago: what is left of ``prefill_s`` for each that is younger."""
    return sum(max(0.0, prefill_s - age) for age in ages)


class SendLog:
    """When the router sent each replica the requests it still holds: of its sends to a
    replica, the newest ``queue depth`` (requests end about in the order they came, and the
    router learns only how many a replica holds). A request another router sent there is not
    in it, so it counts as past its prefill. Times are passed in: no clock is read here."""

    def __init__(self, keep: int = 4096) -> None:
        self._keep = keep
        self._sent: dict[str, deque[float]] = {}

    def sent(self, replica_id: str, now: float) -> None:
        """The router sent a request to ``replica_id`` at ``now``."""
        self._sent.setdefault(replica_id, deque(maxlen=self._keep)).append(now)

    def ages(self, replica_id: str, queue_depth: int, now: float) -> tuple[float, ...]:
        """The ages at ``now`` of the requests ``replica_id`` holds (``queue_depth`` of them),
        newest first; the older sends are forgotten."""
        sent = self._sent.get(replica_id)
        if sent is None:
            return ()
        while len(sent) > max(queue_depth, 0):
            sent.popleft()
        return tuple(now - t for t in reversed(sent))


POLICIES = ("cost-aware", "chunk-affinity", "round-robin", "least-loaded")


def make_policy(name: str, imbalance: int = DEFAULT_IMBALANCE) -> RoutingPolicy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
    if name == "cost-aware":
        return CostAware(imbalance)
    if name == "chunk-affinity":
        return ChunkAffinity(imbalance)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    raise ValueError(f"routing policy must be one of {POLICIES}, got {name!r}")


def _check(replicas: Sequence[ReplicaState]) -> None:
    if not replicas:
        raise ValueError("no replica to route to")


def _held(r: ReplicaState, chunks: Sequence[Sequence[str]]) -> int:
    return r.summary.held(chunks)[0] if r.summary is not None else 0


def _expected_wait(
    r: ReplicaState, costs: ReplicaCosts, chunks: Sequence[Sequence[str]]
) -> tuple[float, int]:
    """``(expected wait, queue depth)`` of a request on ``r`` with ``costs`` (filled in): what
    :class:`CostAware` minimises (the formula in the module docstring)."""
    if costs.prefill_s is not None and r.ages is not None:
        ahead = prefill_ahead(r.ages, costs.prefill_s)
    else:
        ahead = r.queue_depth * costs.service_s
    missing = len(chunks) - _held(r, chunks)
    return ahead + missing * costs.store_chunk_s, r.queue_depth


def _filled_costs(replicas: Sequence[ReplicaState]) -> list[ReplicaCosts] | None:
    """Per replica its costs: its own measurements, else the mean of the replicas that
    measured each; None while no replica has measured ``service_s`` or ``store_chunk_s``
    (``prefill_s`` may stay None: queue depth stands in)."""
    reported = [r.costs or ReplicaCosts() for r in replicas]
    mean = {
        name: _mean([getattr(c, name) for c in reported])
        for name in ("store_chunk_s", "service_s", "prefill_s")
    }
    if mean["service_s"] is None or mean["store_chunk_s"] is None:
        return None
    return [
        ReplicaCosts(
            **{
                name: value if (value := getattr(c, name)) is not None else mean[name]
                for name in mean
            }
        )
        for c in reported
    ]


def _mean(values: Sequence[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return sum(measured) / len(measured) if measured else None


def _seconds(value) -> float | None:
    """A reported measurement: a non-negative number of seconds, else None (not measured)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None
