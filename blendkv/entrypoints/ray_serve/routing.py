"""Which replica serves a request: the one whose memory and device tiers hold most of its chunks.

    a request's chunks ─▶ chunk keys ─▶ digests ─────────┐
    each replica's report: TierSummary (its tiers' keys)  ├─▶ policy.choose ─▶ RoutingDecision
    each replica's queue depth (requests it holds) ───────┘

Every router in the field scores replicas by the *prefix* a request shares with what they
cached. A blend engine reuses chunks wherever they sit in the prompt, so what decides whether a
request loads its chunks from host (or device) memory or from the shared store is the overlap
of its *chunk set* with what a replica's tiers hold. :class:`ChunkAffinity` sends a request to
the replica holding most of its chunks, among the replicas whose queue depth is within
``imbalance`` of the least loaded one; when none of those holds any of them, to the least
loaded. :class:`RoundRobin` and :class:`LeastLoaded` are the baselines (Ray Serve's default,
power of two choices, is least loaded among two at random).

Pure Python, no Ray: the Ray Serve request router (:mod:`.router`) and the simulation to 64
replicas (``blendkv bench route-sim``) run this same code. A replica reports a
:class:`TierSummary` (the digests of the keys its tiers hold, rebuilt only when the tiers'
generation moved), so the router never asks a replica anything per request.

A chunk may have more than one key a replica could hold it under (a document sent in a request
is found under the store's anchor when it was ingested, else under the query-time anchor), so a
request's chunks are given as, per chunk, the digests of its candidate keys.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
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
class ReplicaState:
    """What the router knows of one replica: its id, how many requests it holds now (running
    and queued) and its last reported summary (None: none reported yet)."""

    replica_id: str
    queue_depth: int
    summary: TierSummary | None = None


@dataclass(frozen=True)
class RoutingDecision:
    """The replica chosen, why (``"affinity"``: most chunks held within the bound;
    ``"least_loaded"``: none of the replicas in the bound holds any; ``"round_robin"``), and
    how many of the request's chunks its tiers hold."""

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


POLICIES = ("chunk-affinity", "round-robin", "least-loaded")


def make_policy(name: str, imbalance: int = DEFAULT_IMBALANCE) -> RoutingPolicy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
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
