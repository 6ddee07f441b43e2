"""The Ray Serve request router of the engine replicas: a routing policy (:mod:`.routing`) on
what Ray Serve already knows of each replica.

Ray Serve gives a custom router the candidate replicas, each with the routing stats it last
reported (:meth:`BlendKVReplica.record_routing_stats
<blendkv.entrypoints.ray_serve.replica.BlendKVReplica.record_routing_stats>`: its tier
summary and measured costs), and keeps their queue depths (ongoing requests) in a cache it
updates as requests are sent and finish, probing a replica it has no fresh number for. This
router reads the request's chunks from the :class:`~.replica.ForwardedRequest`, adds when it
sent each replica the requests it holds (:class:`~.routing.SendLog`), asks the policy, and
ranks the chosen replica first and the others by queue depth after it: Ray Serve sends to the
first rank that has room (``max_ongoing_requests``), so a full replica never blocks a request.

The policy is set per deployment (``request_router_kwargs``): ``cost-aware`` (least expected
wait; chunk affinity with the ``imbalance`` bound until the replicas measured their costs),
``chunk-affinity`` with its ``imbalance`` bound, or the baselines ``round-robin`` and
``least-loaded``.
"""

from __future__ import annotations

import logging
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from blendkv.entrypoints.ray_serve.routing import (
    DEFAULT_IMBALANCE,
    ReplicaCosts,
    ReplicaState,
    SendLog,
    TierSummary,
    make_policy,
)

logger = logging.getLogger(__name__)


class BlendKVRouter(RequestRouter):
    """See the module docstring."""

    def initialize_state(
        self, policy: str = "cost-aware", imbalance: int = DEFAULT_IMBALANCE
    ) -> None:
        self.policy = make_policy(policy, imbalance)
        self._summaries: dict[str, tuple[int, TierSummary]] = {}  # replica -> parsed, by gen
        self._sends = SendLog()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        depths = await self._queue_depths(candidate_replicas)
        now = time.monotonic()
        states = [
            ReplicaState(
                r.replica_id.unique_id,
                depths[r.replica_id],
                self._summary(r),
                _costs(r),
                self._sends.ages(r.replica_id.unique_id, depths[r.replica_id], now),
            )
            for r in candidate_replicas
        ]
        decision = self.policy.choose(_request_chunks(pending_request), states)
        self._sends.sent(decision.replica_id, now)
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == decision.replica_id]
        others = sorted(
            (r for r in candidate_replicas if r not in chosen), key=lambda r: depths[r.replica_id]
        )
        logger.debug("routed to %s (%s)", decision.replica_id, decision.reason)
        return [chosen, others] if others else [chosen]

    async def _queue_depths(self, replicas: list[RunningReplica]) -> dict:
        """replica id -> requests it holds: Ray Serve's cached number, else probed now (a
        replica that does not answer in time counts as full)."""
        cache = self.replica_queue_len_cache
        depths = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        unknown = [r for r in replicas if depths[r.replica_id] is None]
        if unknown:
            for r, depth in await self._probe_queue_lens(unknown, 0):
                depths[r.replica_id] = r.max_ongoing_requests if depth is None else depth
        return depths

    def _summary(self, replica: RunningReplica) -> TierSummary | None:
        """The replica's last reported tier summary, parsed once per generation."""
        raw = (replica.routing_stats or {}).get("tiers")
        if raw is None:
            return None
        rid = replica.replica_id.unique_id
        cached = self._summaries.get(rid)
        if cached is None or cached[0] != raw["generation"]:
            cached = self._summaries[rid] = (raw["generation"], TierSummary.from_dict(raw))
        return cached[1]


def _costs(replica: RunningReplica) -> ReplicaCosts | None:
    """The replica's last reported costs (None: none reported yet)."""
    raw = (replica.routing_stats or {}).get("costs")
    return None if raw is None else ReplicaCosts.from_dict(raw)


def _request_chunks(pending: PendingRequest | None) -> list:
    """The chunks a forwarded request carries (none for anything else, e.g. a health call)."""
    if pending is None:
        return []
    for arg in pending.args:
        chunks = getattr(arg, "chunks", None)
        if chunks is not None:
            return chunks
    return []
