"""The blend audit: a sampled fraction of blended requests also runs full prefill, off the
critical path, to watch fusion quality in production. An engine-level policy: the engine owns
the :class:`Auditor`, the scheduler hands out its work, the model runner runs it.

``EngineConfig.blend_audit_rate`` picks requests whose K/V is not exactly full prefill's (the
KV connector says so: ``ConnectorPrompt.approximate``) with a seeded draw (deterministic for a
seed and an arrival order). An audited request's last prompt row logits (its first token's
distribution) are kept when its fused prefill samples; its answer is untouched. When the request
is finished (or aborted after its first token), its audit is ready: the scheduler hands it out
(``SchedulerOutput.audits``) only in a step where nothing else waits or runs (no running,
waiting or precomputing request), and the runner runs it as one dense forward of the prompt (no
KV pool, like chunk precompute). KL(full || blend) and top-1 agreement of the two distributions
become an :class:`AuditRecord`, readable from ``engine.blend_audit_records()`` /
``LLM.blend_audit_records()`` and ``/metrics`` histograms.

Pending audits are bounded (``MAX_PENDING``): under a load that never idles the oldest are
dropped (counted in ``num_dropped``) rather than growing without end.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blendkv.engine.scheduler_output import AuditWork

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_WARN_KL",
    "MAX_PENDING",
    "AuditRecord",
    "AuditWatch",
    "Auditor",
]

logger = logging.getLogger(__name__)

MAX_PENDING = 64  # audits waiting for an idle step; older ones are dropped beyond it
MAX_RECORDS = 1024  # records kept for readers (the oldest go first)
# `blendkv serve --blend-audit-warn-kl`: mean first-token KL(full || blend), nats, over the last
# WARN_WINDOW audits above which the server warns (docs/guide/blending.md, "The blend audit").
DEFAULT_WARN_KL = 0.25
WARN_WINDOW = 50


@dataclass(frozen=True)
class AuditRecord:
    """One audited request: its first-token distribution under blend vs full prefill."""

    request_id: str
    kl: float  # KL(full || blend) of the last prompt row, nats
    top1_agree: bool  # both distributions' argmax is the same token
    full_top1: int
    blend_top1: int
    num_prompt_tokens: int


@dataclass
class _Audit:
    request_id: str
    token_ids: list[int]
    blend_logits: object = None  # [V] tensor on the CPU, once the first token was sampled
    stats: object = None  # the request's BlendStats: the record lands in its ``audit``
    done: bool = False  # the request finished: the audit may run


class Auditor:
    """Chooses audited requests, keeps their blend logits, hands out their full prefills and
    records the comparison. Pure Python but for the logits it is handed.

    The engine owns it: it asks which requests need their last prompt row's logits
    (:meth:`wants_logits`), hands them over (:meth:`take_logits`), and the full prefill's
    (:meth:`record`); the scheduler takes ready audits (:meth:`next_work`)."""

    def __init__(self, rate: float, seed: int) -> None:
        assert 0.0 <= rate <= 1.0
        self.rate = rate
        self._rng = random.Random(seed)
        self._audits: dict[str, _Audit] = {}  # by request id, in arrival order
        self._hidden: set[str] = set()  # requests whose prompt logits the user did not ask
        self.records: deque[AuditRecord] = deque(maxlen=MAX_RECORDS)
        self._new: list[AuditRecord] = []  # not yet taken by take_new_records
        self._running: dict[str, _Audit] = {}  # handed out by next_work, not yet recorded
        self.num_dropped = 0

    # ---- requests -----------------------------------------------------------------------
    def choose(self, request_id: str, token_ids: list[int], stats: object = None) -> bool:
        """Draw for one blended request (one draw per request, in arrival order); ``stats``
        (its BlendStats, seen by the user's outputs) gets the record as ``stats.audit``."""
        if self.rate <= 0.0 or request_id.startswith("blendkv-start-gate"):
            return False
        if self._rng.random() >= self.rate:
            return False
        self._audits[request_id] = _Audit(request_id, list(token_ids), stats=stats)
        return True

    def is_audited(self, request_id: str) -> bool:
        return request_id in self._audits

    def wants_logits(self, request_id: str, user_logits_from: int | None) -> int | None:
        """The ``logits_from`` the engine sets on an audited sequence: the user's, else the last
        prompt row (then hidden from the request's output)."""
        audit = self._audits.get(request_id)
        if audit is None or user_logits_from is not None:
            return user_logits_from
        self._hidden.add(request_id)
        return len(audit.token_ids) - 1

    def take_logits(self, request_id: str, logits) -> bool:
        """Keep the last row of a step's prompt logits for ``request_id``; True when they were
        only asked for the audit (the engine then does not hand them to the request)."""
        audit = self._audits.get(request_id)
        if audit is None:
            return False
        audit.blend_logits = logits[-1].float().clone()
        return request_id in self._hidden

    def request_finished(self, request_id: str) -> None:
        """The answer is done: the audit may run if the blend's first token was sampled."""
        self._hidden.discard(request_id)
        audit = self._audits.get(request_id)
        if audit is None:
            return
        if audit.blend_logits is None:  # aborted before its first token: nothing to compare
            del self._audits[request_id]
            return
        audit.done = True
        ready = [a for a in self._audits.values() if a.done]
        for old in ready[: max(0, len(ready) - MAX_PENDING)]:
            del self._audits[old.request_id]
            self.num_dropped += 1

    # ---- work ---------------------------------------------------------------------------
    def next_work(self) -> AuditWork | None:
        """The oldest audit ready to run (its full prefill), or None; taken: the engine records
        it (:meth:`record`) once the runner ran it."""
        for audit in self._audits.values():
            if audit.done:
                del self._audits[audit.request_id]
                self._running[audit.request_id] = audit
                return AuditWork(audit.request_id, tuple(audit.token_ids))
        return None

    def has_work(self) -> bool:
        return any(a.done for a in self._audits.values())

    def record(self, request_id: str, full_logits: torch.Tensor) -> AuditRecord:
        """Compare the full prefill's last-row logits ``[V]`` with the blend's and keep it."""
        from blendkv.guards.fidelity import kl_divergence

        audit = self._running.pop(request_id)
        blend = audit.blend_logits
        record = AuditRecord(
            request_id=audit.request_id,
            kl=float(kl_divergence(full_logits, blend)),
            top1_agree=int(full_logits.argmax()) == int(blend.argmax()),
            full_top1=int(full_logits.argmax()),
            blend_top1=int(blend.argmax()),
            num_prompt_tokens=len(audit.token_ids),
        )
        self.records.append(record)
        self._new.append(record)
        if audit.stats is not None:  # not a dataclass field: to_dict() stays as it was
            audit.stats.audit = record
        return record

    def take_new_records(self) -> list[AuditRecord]:
        """Records landed since the last call (for one reader: the server's metrics)."""
        new, self._new = self._new, []
        return new

    def recent_mean_kl(self, n: int) -> float | None:
        """Mean KL of the last ``n`` records, None without any."""
        recent = list(self.records)[-n:]
        return sum(r.kl for r in recent) / len(recent) if recent else None


class AuditWatch:
    """Warns (once per crossing) when the mean KL of the last ``window`` audits passes
    ``warn_kl``; warns again only after the mean fell back below it."""

    def __init__(self, warn_kl: float = DEFAULT_WARN_KL, window: int = WARN_WINDOW) -> None:
        self.warn_kl = warn_kl
        self._recent: deque[float] = deque(maxlen=window)
        self.warning = False  # the mean is above the threshold now

    def observe(self, record: AuditRecord) -> None:
        self._recent.append(record.kl)
        mean = sum(self._recent) / len(self._recent)
        if mean > self.warn_kl and not self.warning:
            logger.warning(
                "blend audit: mean first-token KL(full || blend) of the last %d audited requests "
                "is %.3g nats, above --blend-audit-warn-kl %g: blending degrades answers on "
                "this traffic (raise recompute_ratio, or check the model's blend support)",
                len(self._recent),
                mean,
                self.warn_kl,
            )
        self.warning = mean > self.warn_kl
