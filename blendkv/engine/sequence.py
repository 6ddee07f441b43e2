"""A request's state inside the engine: token ids, progress counters, its block table.

Pure Python. The scheduler and the block manager read and move these counters; the model runner
only reads them.

    all_token_ids: | prompt ............................ | outputs ...... |
    computed:      | num_computed_tokens -->|  (K/V in the paged cache)
    this step:                              |<- num_scheduled_tokens ->|
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blendkv.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    # Its documents' K/V is being precomputed (KV connector work scheduled like prefill); it
    # holds no blocks until every chunk is ready, then becomes WAITING.
    PRECOMPUTING = "precomputing"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )


@dataclass
class SequenceMetrics:
    """Timestamps (``time.perf_counter`` seconds) and counters reported back to the user."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0


class Sequence:
    """One request (vLLM's ``Request``): prompt plus the tokens generated so far."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_output_tokens: int,
    ) -> None:
        assert prompt_token_ids, "empty prompts are rejected before they become sequences"
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.max_output_tokens = max_output_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # rows of its last prefill piece: a piece beside decodes at most doubles (Scheduler)
        self.last_piece_rows = 0
        # The block manager owns this list; the runner reads it to build block tables.
        self.block_table: list[int] = []
        self.metrics = SequenceMetrics()
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # Mixed into every block hash: K/V computed differently (blending) never aliases plain.
        self.cache_salt = b""
        # Return the logits of every prompt position >= this one (teacher forcing, eval).
        self.logits_from: int | None = None
        # Parallel sampling (n > 1): the other samples of this request, forked from it by the
        # scheduler in the step that computes the prompt's last token (they share its blocks).
        self.pending_children: list[Sequence] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id_at(self, position: int) -> int:
        if position < len(self.prompt_token_ids):
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - len(self.prompt_token_ids)]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )
