"""The server's recent health, as ``GET /v1/blendkv/health`` and the ``/ui`` page's Health tab
read it: the last requests' TTFT and where their chunks came from, the last blend audits.

Prometheus (``/metrics``) keeps counters and histograms since start, for a scraper that keeps
the history; this keeps a bounded window of raw samples (exact percentiles, points to plot) for
someone looking at the server now. The engine thread appends (:class:`ServerMetrics` feeds it
after every step); route handlers read a snapshot.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from blendkv.outputs import RequestOutput

WINDOW = 500  # requests (and audits) kept
PERCENTILES = (50, 90, 99)
# BlendStats counters summed over the window, chunk counts by where their K/V came from.
_TIER_FIELDS = ("chunks_on_device", "chunks_in_memory", "chunks_hit", "chunks_missed")


@dataclass(frozen=True)
class RequestSample:
    """One request at its first token. ``time``: Unix seconds; ``ttft``: seconds."""

    time: float
    ttft: float | None
    prompt_tokens: int
    blended: bool = False
    tokens_reused: int = 0
    reused_tokens_recomputed: int = 0
    chunks_on_device: int = 0
    chunks_in_memory: int = 0
    chunks_hit: int = 0
    chunks_missed: int = 0
    full_prefill: bool = False  # blended prompt run as full prefill (cost check, start gate)

    def to_dict(self) -> dict:
        return {
            "time": self.time,
            "ttft": self.ttft,
            "prompt_tokens": self.prompt_tokens,
            "blended": self.blended,
            "tokens_reused": self.tokens_reused,
            "reused_tokens_recomputed": self.reused_tokens_recomputed,
            "full_prefill": self.full_prefill,
        }


@dataclass(frozen=True)
class AuditSample:
    time: float
    kl: float  # first-token KL(full prefill || blend), nats
    top1_agree: bool
    num_prompt_tokens: int
    max_kl: float = 0.0  # the largest over the answer's first tokens: what a target bounds
    fidelity_target: float | None = None  # nats; None: the request set no target
    recompute_ratio: float | None = None  # with a target, the ratio it ran at


def percentile(sorted_values: list[float], p: float) -> float | None:
    """The ``p``-th percentile (0..100) of ascending values, linearly interpolated."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


class HealthLog:
    def __init__(self, window: int = WINDOW) -> None:
        self.started = time.time()
        self._requests: deque[RequestSample] = deque(maxlen=window)
        self._audits: deque[AuditSample] = deque(maxlen=window)
        self._lock = threading.Lock()

    def on_first_token(self, out: RequestOutput) -> None:
        """Engine thread: a request sampled its first token."""
        stats, ttft = out.blend_stats, out.metrics.ttft
        fields = {}
        if stats is not None:
            fields = {name: getattr(stats, name) for name in _TIER_FIELDS}
            fields.update(
                blended=True,
                tokens_reused=stats.tokens_reused,
                reused_tokens_recomputed=stats.reused_tokens_recomputed,
                full_prefill=bool(getattr(stats, "fallback", "")),
            )
        sample = RequestSample(time.time(), ttft, len(out.prompt_token_ids), **fields)
        with self._lock:
            self._requests.append(sample)

    def on_audit(self, record) -> None:
        """Engine thread: a blend audit (:class:`~blendkv.guards.audit.AuditRecord`) landed."""
        sample = AuditSample(
            time.time(),
            record.kl,
            record.top1_agree,
            record.num_prompt_tokens,
            record.max_kl,
            record.fidelity_target,
            record.recompute_ratio,
        )
        with self._lock:
            self._audits.append(sample)

    def snapshot(self) -> dict:
        """The window: TTFT percentiles, chunk hit rates by tier, audits, and the samples."""
        with self._lock:
            requests, audits = list(self._requests), list(self._audits)
        ttfts = sorted(r.ttft for r in requests if r.ttft is not None)
        blended = [r for r in requests if r.blended]
        return {
            "started": self.started,
            "now": time.time(),
            "window": self._requests.maxlen,
            "requests": len(requests),
            "ttft": {
                "count": len(ttfts),
                **{f"p{p}": percentile(ttfts, p) for p in PERCENTILES},
            },
            "tiers": _tiers(blended),
            "audit": _audits(audits),
            "samples": [r.to_dict() for r in requests],
        }


def _tiers(blended: list[RequestSample]) -> dict:
    """Chunks of the window's blended requests by where their K/V came from, and rates."""
    device = sum(r.chunks_on_device for r in blended)
    memory = sum(r.chunks_in_memory for r in blended)
    hit = sum(r.chunks_hit for r in blended)
    missed = sum(r.chunks_missed for r in blended)
    chunks = {"device": device, "memory": memory, "store": hit - device - memory, "missed": missed}
    total = hit + missed
    return {
        "blended_requests": len(blended),
        "chunks": chunks,
        "rates": {k: (v / total if total else None) for k, v in chunks.items()},
        "hit_rate": hit / total if total else None,
    }


def _audits(audits: list[AuditSample]) -> dict:
    kls = [a.kl for a in audits]
    return {
        "count": len(audits),
        "mean_kl": sum(kls) / len(kls) if kls else None,
        "top1_agreement": sum(a.top1_agree for a in audits) / len(audits) if audits else None,
        "fidelity": _fidelity(audits),
        "samples": [
            {"time": a.time, "kl": a.kl, "top1_agree": a.top1_agree, "tokens": a.num_prompt_tokens}
            for a in audits
        ],
    }


def _fidelity(audits: list[AuditSample]) -> list[dict]:
    """Per fidelity target among the window's audits: how many, the 90th percentile of their
    divergence (what the target bounds), whether it is within the target, and the ratio the
    last of them ran at (the one the engine holds the target at now)."""
    out = []
    for target in sorted({a.fidelity_target for a in audits if a.fidelity_target is not None}):
        mine = [a for a in audits if a.fidelity_target == target]
        p90 = percentile(sorted(a.max_kl for a in mine), 90)
        out.append(
            {
                "target": target,
                "audits": len(mine),
                "p90_max_kl": p90,
                "within": p90 <= target,
                "recompute_ratio": mine[-1].recompute_ratio,
            }
        )
    return out
