"""What the scheduler hands the model runner for one step (and the KV connector reads).

Its own module, as in vLLM (``v1/core/sched/output.py``): the runner and the connector depend on
this contract, not on the scheduler that fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from blendkv.engine.step_cost import StepWork

if TYPE_CHECKING:
    from blendkv.engine.kv_connector import KVConnectorMetadata
    from blendkv.engine.sequence import Sequence


@dataclass
class SchedulerOutput:
    """The contract between scheduler and model runner for one step: what the runner runs.

    Four kinds of work, each run by the model runner:

    - ``scheduled``: (sequence, num_scheduled_tokens) in batch order, one flattened forward; a
      sequence's tokens this step are positions
      ``[num_computed_tokens, num_computed_tokens + n)``. ``forked`` maps a scheduled
      sequence's request id to the sequences forked from it this step (``n > 1``): they run no
      tokens, and each samples its first token from the same logits row.
    - ``query_passes``: request ids among ``scheduled`` whose fused prefill first runs a query
      pass (ProphetKV's first stage: the rows without reused K/V over the loaded K/V, to score
      which reused rows the forward recomputes).
    - ``precompute``: document chunks whose K/V a waiting request needs (see
      :class:`PrecomputeWork`), one forward each, before the batch.
    - ``audits``: full prefills of audited requests (see :class:`AuditWork`), only in an
      otherwise idle step.
    """

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    forked: dict[str, list[Sequence]] = field(default_factory=dict)
    kv_connector_metadata: KVConnectorMetadata | None = None
    query_passes: list[str] = field(default_factory=list)
    precompute: list[PrecomputeWork] = field(default_factory=list)
    audits: list[AuditWork] = field(default_factory=list)
    # What the batch's forward(s) take on (the precompute items apart): the engine records
    # the step's measured time against it (blendkv.engine.step_cost).
    work: StepWork = field(default_factory=StepWork)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_precompute_tokens(self) -> int:
        return sum(w.num_tokens for w in self.precompute)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.precompute and not self.audits


@dataclass(frozen=True)
class PrecomputeWork:
    """One document chunk of request ``request_id`` whose K/V is not stored: the connector's
    chunk ``index``. The runner prefills ``context_ids + chunk_ids`` (one forward, no KV
    pool) and hands the chunk rows' K/V to the connector, which stores it."""

    request_id: str
    index: int
    context_ids: tuple[int, ...]
    chunk_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.context_ids) + len(self.chunk_ids)


@dataclass(frozen=True)
class AuditWork:
    """Full prefill of an audited request (``blendkv.guards.audit``): its prompt and the first
    answer tokens the blend drew but the last kept one. The runner computes the logits of the
    last ``num_rows`` rows (the last prompt row and each answer position's), one forward
    without the KV pool."""

    request_id: str
    token_ids: tuple[int, ...]
    num_rows: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
