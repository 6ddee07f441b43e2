"""The blend audit: a sampled fraction of blended requests also runs full prefill, off the
critical path, to watch fusion quality in production. An engine-level policy: the engine owns
the :class:`Auditor`, the scheduler hands out its work, the model runner runs it.

``EngineConfig.blend_audit_rate`` picks requests whose K/V is not exactly full prefill's (the
KV connector says so: ``ConnectorPrompt.approximate``) with a seeded draw (deterministic for a
seed and an arrival order). An audited request keeps the logits each of its first
``ANSWER_TOKENS`` tokens was sampled from (the last prompt row's, then each decode step's) and
those tokens; its answer is untouched. When the request is finished (or aborted after its first
token), its audit is ready: the scheduler hands it out (``SchedulerOutput.audits``) only in a
step where nothing else waits or runs (no running, waiting or precomputing request), and the
runner runs it as one dense forward (no KV pool, like chunk precompute) of the prompt and the
blend's answer but its last kept token, which gives full prefill's distribution at each kept
position, teacher-forced on the blend's own answer::

    prompt tokens            answer a0 a1 ... a(k-1)  (k <= ANSWER_TOKENS sampled by the blend)
    |<---------- full prefill's forward ---------->|
                        row k-1 of the prompt ... row of a(k-2): k rows, one per kept row

KL(full || blend) per position becomes an :class:`AuditRecord` (the first token's, the
largest, the argmax flips), readable from ``engine.blend_audit_records()`` /
``LLM.blend_audit_records()`` and ``/metrics`` histograms; an audit of a request whose ratio a
fidelity target chose also feeds the engine's fidelity controller
(:mod:`blendkv.guards.fidelity_controller`).

Pending audits are bounded (``MAX_PENDING``): under a load that never idles the oldest are
dropped (counted in ``num_dropped``) rather than growing without end. Each holds at most
``ANSWER_TOKENS`` rows of vocabulary-sized float32 logits on the CPU.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from blendkv.engine.scheduler_output import AuditWork
from blendkv.guards.measure import ANSWER_TOKENS

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
# WARN_WINDOW audits above which the server warns (docs/guide/fidelity.md, "The blend audit").
DEFAULT_WARN_KL = 0.25
WARN_WINDOW = 50


@dataclass(frozen=True)
class AuditRecord:
    """One audited request: the blend's next-token distributions along its own answer against
    full prefill's, teacher-forced on that answer. KL in nats.

    Attributes:
        request_id: the audited request.
        kl: KL(full prefill || blend) of the first answer token's distribution (the last
            prompt row).
        top1_agree: both first-token distributions have the same argmax.
        full_top1: full prefill's first-token argmax.
        blend_top1: the blend's first-token argmax.
        num_prompt_tokens: the prompt's tokens.
        max_kl: the largest KL(full prefill || blend) over the answer positions compared: the
            divergence a fidelity target bounds.
        flips: answer positions compared where the two argmaxes differ.
        num_answer_tokens: the answer positions compared (the first ``ANSWER_TOKENS`` at most).
        fidelity_target: the request's fidelity target, None when it gave none.
        recompute_ratio: with a fidelity target, the recompute ratio it ran at.
    """

    request_id: str
    kl: float
    top1_agree: bool
    full_top1: int
    blend_top1: int
    num_prompt_tokens: int
    max_kl: float
    flips: int
    num_answer_tokens: int
    fidelity_target: float | None = None
    recompute_ratio: float | None = None


@dataclass
class _Audit:
    request_id: str
    token_ids: list[int]  # the prompt
    stats: object = None  # the request's BlendStats: the record lands in its ``audit``
    fidelity_target: float | None = None
    recompute_ratio: float | None = None
    rows: list = field(default_factory=list)  # [V] CPU logits each answer token was drawn from
    answer: list[int] = field(default_factory=list)  # the tokens drawn, as many as rows
    done: bool = False  # the request finished: the audit may run


class Auditor:
    """Chooses audited requests, keeps the logits their first answer tokens were sampled from,
    hands out their full prefills and records the comparison. Pure Python but for the logits
    it is handed.

    The engine owns it: it hands over each sampled row of an audited request
    (:meth:`take_sample`), and the full prefill's rows (:meth:`record`); the scheduler takes
    ready audits (:meth:`next_work`)."""

    def __init__(self, rate: float, seed: int) -> None:
        assert 0.0 <= rate <= 1.0
        self.rate = rate
        self._rng = random.Random(seed)
        self._audits: dict[str, _Audit] = {}  # by request id, in arrival order
        self.records: deque[AuditRecord] = deque(maxlen=MAX_RECORDS)
        self._new: list[AuditRecord] = []  # not yet taken by take_new_records
        self._running: dict[str, _Audit] = {}  # handed out by next_work, not yet recorded
        self.num_dropped = 0

    # ---- requests -----------------------------------------------------------------------
    def choose(
        self,
        request_id: str,
        token_ids: list[int],
        stats: object = None,
        fidelity_target: float | None = None,
        recompute_ratio: float | None = None,
    ) -> bool:
        """Draw for one blended request (one draw per request, in arrival order); ``stats``
        (its BlendStats, seen by the user's outputs) gets the record as ``stats.audit``; a
        request whose ratio a fidelity target chose passes both (they land in the record)."""
        if self.rate <= 0.0 or request_id.startswith("blendkv-start-gate"):
            return False
        if self._rng.random() >= self.rate:
            return False
        self._audits[request_id] = _Audit(
            request_id, list(token_ids), stats, fidelity_target, recompute_ratio
        )
        return True

    def is_audited(self, request_id: str) -> bool:
        return request_id in self._audits

    def take_sample(self, request_id: str, logits: torch.Tensor, token_id: int) -> None:
        """Keep the logits row ``[V]`` the audited request's next token ``token_id`` was
        sampled from (before any sampling parameter), up to ``ANSWER_TOKENS`` of them."""
        audit = self._audits[request_id]
        if not audit.done and len(audit.rows) < ANSWER_TOKENS:
            audit.rows.append(logits.float().to("cpu", copy=True))
            audit.answer.append(int(token_id))

    def request_finished(self, request_id: str) -> None:
        """The answer is done: the audit may run if the blend's first token was sampled."""
        audit = self._audits.get(request_id)
        if audit is None:
            return
        if not audit.rows:  # aborted before its first token: nothing to compare
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
                # the last kept token is never fed back: its row is the one before it
                token_ids = audit.token_ids + audit.answer[:-1]
                return AuditWork(audit.request_id, tuple(token_ids), len(audit.rows))
        return None

    def has_work(self) -> bool:
        return any(a.done for a in self._audits.values())

    def record(self, request_id: str, full_logits: torch.Tensor) -> AuditRecord:
        """Compare the full prefill's rows ``[k, V]`` (one per kept answer position, see
        :class:`AuditWork`) with the blend's and keep the record."""
        import torch

        from blendkv.guards.fidelity import kl_divergence

        audit = self._running.pop(request_id)
        blend = torch.stack(audit.rows)
        assert full_logits.shape == blend.shape, (tuple(full_logits.shape), tuple(blend.shape))
        kls = kl_divergence(full_logits, blend)
        full_top1, blend_top1 = full_logits.argmax(dim=-1), blend.argmax(dim=-1)
        record = AuditRecord(
            request_id=audit.request_id,
            kl=float(kls[0]),
            top1_agree=bool(full_top1[0] == blend_top1[0]),
            full_top1=int(full_top1[0]),
            blend_top1=int(blend_top1[0]),
            num_prompt_tokens=len(audit.token_ids),
            max_kl=float(kls.max()),
            flips=int((full_top1 != blend_top1).sum()),
            num_answer_tokens=len(audit.rows),
            fidelity_target=audit.fidelity_target,
            recompute_ratio=audit.recompute_ratio,
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
