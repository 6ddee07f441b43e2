"""What the scheduler hands the model runner for one step (and the KV connector reads).

Its own module, as in vLLM (``v1/core/sched/output.py``): the runner and the connector depend on
this contract, not on the scheduler that fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blendkv.engine.kv_connector import KVConnectorMetadata
    from blendkv.engine.sequence import Sequence


@dataclass
class SchedulerOutput:
    """The contract between scheduler and model runner for one step.

    ``scheduled`` lists (sequence, num_scheduled_tokens) in batch order; a sequence's tokens
    this step are positions ``[num_computed_tokens, num_computed_tokens + n)``. ``forked`` maps
    a scheduled sequence's request id to the sequences forked from it this step (``n > 1``):
    they run no tokens, and each samples its first token from the same logits row.
    ``precompute`` lists the KV connector's side work this step (a request's document chunks,
    one forward each, run before the batch; see :class:`PrecomputeWork`).
    """

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    forked: dict[str, list[Sequence]] = field(default_factory=dict)
    kv_connector_metadata: KVConnectorMetadata | None = None
    precompute: list[PrecomputeWork] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_precompute_tokens(self) -> int:
        return sum(w.num_tokens for w in self.precompute)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.precompute


@dataclass(frozen=True)
class PrecomputeWork:
    """One unit of a request's precompute: the connector's item ``index`` (a document chunk)
    of request ``request_id``, costing ``num_tokens`` of the step's token budget."""

    request_id: str
    index: int
    num_tokens: int
