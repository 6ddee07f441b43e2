"""Continuous-batching scheduler. Pure Python: decides *which* tokens run, touches no tensors.

Every step it fills one token budget (``max_num_batched_tokens``) and, while requests decode
or more than one request is in the engine, a time budget (``max_step_latency`` seconds of
predicted prefill and precompute, from the engine's
:class:`~blendkv.engine.step_cost.StepCostModel`: a long prompt is split finer and a request's
new documents spread over more steps, so the decodes' tokens keep coming; a piece at most
doubles from one step to the next, so each size is measured before a larger one runs; a lone
request takes full-size steps; each step still makes some progress on the oldest prefill)
with, in order:

1. running sequences — a decode token each, or the next piece of a chunked prefill (while
   other requests wait, running prefills take at most half the budget, so a long prompt
   cannot hold up new requests until it is done); when the block pool runs dry the most
   recently admitted running sequence is preempted (its blocks freed, its tokens recomputed
   later) until the current one fits;
2. waiting sequences (new or preempted), first-come first-served, while budget, blocks and
   ``max_num_seqs`` allow, after taking their prefix-cache hits and the tokens a KV connector
   supplies (``get_num_new_matched_tokens``). A prefill the connector must run whole (a fused
   blended prefill, ``fused_prefill_cost``) is never chunked. A request whose K/V the
   connector is still reading (``kv_ready``) lets the requests behind it pass, unless nothing
   else would run;
3. precompute the KV connector asks for before a request can be admitted (a blended request's
   documents whose K/V is not stored: ``get_precompute_work``), first-come first-served, each
   item costing its tokens; an item larger than the whole budget runs alone among the step's
   prefills. Such a request is ``PRECOMPUTING`` (in :attr:`Scheduler.precomputing`, holding no
   blocks) until its last item ran, then it joins the waiting queue. Spread over steps this
   way, a request with many new documents never stalls the decodes and prefills of others;
4. an audit's full prefill (``blendkv.guards.audit``), only in a step where no request runs,
   waits or precomputes.

A fused prefill whose connector wants a query pass first (``FusedPrefillCost.query_pass``:
ProphetKV's first stage) is listed in ``SchedulerOutput.query_passes``; the runner runs both.

A request with ``n > 1`` samples is one sequence until its prompt is computed: in the step that
computes the prompt's last token, its other samples (``Sequence.pending_children``) are forked
from it, sharing its blocks by reference count (the partly filled last block is copied on the
first write). Each takes a ``max_num_seqs`` slot from admission on.

Prefill and decode tokens share one flattened batch; the runner receives a
:class:`~blendkv.engine.scheduler_output.SchedulerOutput` and nothing else.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING

from blendkv.engine.block_manager import BlockManager
from blendkv.engine.scheduler_output import SchedulerOutput
from blendkv.engine.sequence import Sequence, SequenceStatus
from blendkv.engine.step_cost import StepCostModel, StepWork, chunk_forward_work, prefill_work

if TYPE_CHECKING:
    from blendkv.engine.kv_connector import KVConnectorBase
    from blendkv.guards.audit import Auditor


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        connector: KVConnectorBase | None = None,
        auditor: Auditor | None = None,
        max_step_latency: float | None = None,
        step_costs: StepCostModel | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.connector = connector
        self.auditor = auditor
        self.max_step_latency = max_step_latency
        self.step_costs = step_costs
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Requests whose connector precompute is not done (no blocks), in arrival order.
        self.precomputing: list[Sequence] = []

    # ------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING
        if self.connector is not None and self.connector.get_precompute_work(seq):
            seq.status = SequenceStatus.PRECOMPUTING
            self.precomputing.append(seq)
        else:
            self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is; returns it, or None if unknown or finished."""
        for queue in (self.precomputing, self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                    return seq
        return None

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Called by the engine when a running sequence hit a stop condition."""
        assert status.is_finished
        self.running.remove(seq)
        self._finish(seq, status)

    def has_unfinished(self) -> bool:
        if self.waiting or self.running or self.precomputing:
            return True
        return self.auditor is not None and self.auditor.has_work()

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._time = _TimeBudget(self._seconds_for_prefills(), self.step_costs)
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_waiting(out, budget)
        self._schedule_precompute(out, budget)
        idle = not (self.running or self.waiting or self.precomputing)
        if idle and self.auditor is not None:
            audit = self.auditor.next_work()
            if audit is not None:
                out.audits.append(audit)
        self._fork(out)
        out.work = self._time.batch + StepWork(1 if out.scheduled else 0, *self._decode_work(out))
        out.blocks_to_copy = self.block_manager.take_pending_copies()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Others waiting (admission or precompute): prefill pieces leave them half the budget.
        others = (self.waiting and self._num_seq_slots() < self.max_num_seqs) or self.precomputing
        prefill_room = max(1, budget // 2) if others else budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_left = seq.num_tokens - seq.num_computed_tokens
            assert num_left > 0, f"running sequence with nothing to compute: {seq}"
            num_new = min(num_left, budget if num_left == 1 else min(prefill_room, budget))
            if num_left > 1:  # a prefill piece: what fits the step's time too
                num_new = self._time.rows(seq.num_computed_tokens, num_new, seq.last_piece_rows)
            if num_new == 0:  # a prefill piece, and the prefills' share is spent
                i += 1
                continue
            if num_left > 1:
                prefill_room -= num_new
                seq.last_piece_rows = num_new
                self._time.take(prefill_work(seq.num_computed_tokens, num_new))
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()  # lowest priority: admitted last, not yet scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            out.scheduled.append((seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        conn = self.connector
        reading = []  # waiting requests whose K/V the connector is still reading
        while self.waiting and budget > 0 and self._num_seq_slots() < self.max_num_seqs:
            seq = self.waiting[0]
            if conn is not None and not conn.kv_ready(seq):
                reading.append(self.waiting.popleft())
                continue
            left = self._admit(seq, out, budget)
            if left is None:
                break
            budget = left
        self.waiting.extendleft(reversed(reading))
        if reading and not out.scheduled and not self.running:
            # Nothing else would run: waiting for the reads would only idle the engine.
            left = self._admit(self.waiting[0], out, budget)
            budget = budget if left is None else left
        return budget

    def _schedule_precompute(self, out: SchedulerOutput, budget: int) -> None:
        """Fill what is left of the budget with precompute items, oldest request first. An
        item that does not fit stops the queue (no later item passes it) unless it could never
        fit: then it goes alone, without other prefills or precompute in the step."""
        if not self.precomputing or budget <= 0:
            return
        prefills = any(n > 1 for _, n in out.scheduled)
        for seq in self.precomputing:
            for work in self.connector.get_precompute_work(seq):
                cost = work.num_tokens
                if cost > budget:
                    oversized = cost > self.max_num_batched_tokens
                    if not (oversized and not prefills and not out.precompute):
                        return
                forward = chunk_forward_work(cost)
                if not self._time.fits(forward) and self._time.progressed:
                    return  # the step's time is spent (decodes are waiting for it)
                self._time.take(forward, in_batch=False)
                out.precompute.append(work)
                budget -= cost
                if budget <= 0:
                    return

    def _admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """Schedule ``seq``, the head of the waiting queue: the budget left, or None if it did
        not fit (no budget or blocks; it stays at the head)."""
        bm, conn = self.block_manager, self.connector
        if self._num_seq_slots() + 1 + len(seq.pending_children) > self.max_num_seqs:
            return None
        computed_blocks, num_cached = bm.get_computed_blocks(seq)
        num_external = 0
        if conn is not None:
            # At least one token is computed: its logits are sampled.
            room = seq.num_tokens - num_cached - 1
            num_external = min(conn.get_num_new_matched_tokens(seq, num_cached), room)
        num_new = seq.num_tokens - num_cached - num_external
        cost = num_new
        fused = None
        if conn is not None:
            fused = conn.fused_prefill_cost(seq, num_cached + num_external, num_new)
        prefills_scheduled = any(n > 1 for _, n in out.scheduled)
        if fused is not None:
            # A fused prefill runs whole. It waits for budget unless it could never fit,
            # then it goes alone among this step's prefills so it cannot starve.
            cost = fused.tokens
            if cost > budget and (cost <= self.max_num_batched_tokens or prefills_scheduled):
                return None
            work = StepWork(int(fused.query_pass), cost, cost * seq.num_tokens)
            if not self._time.fits_whole(work, prefills_scheduled):
                return None
        else:
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    return None
                num_new = cost = budget
            start = num_cached + num_external
            work = prefill_work(start, num_new)
            if self.enable_chunked_prefill:
                num_new = cost = self._time.rows(start, num_new, seq.last_piece_rows)
                work = prefill_work(start, num_new)
                seq.last_piece_rows = num_new
            elif not self._time.fits_whole(work, prefills_scheduled):
                return None
            if num_new == 0:
                return None
        if not bm.allocate_slots(seq, num_external + num_new, computed_blocks):
            return None
        self.waiting.popleft()
        seq.num_computed_tokens = num_cached + num_external
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.perf_counter()
            seq.metrics.num_cached_tokens = num_cached
        if conn is not None:
            conn.update_state_after_alloc(seq, num_external)
            if fused is not None and fused.query_pass:
                out.query_passes.append(seq.request_id)
        self._time.take(work)
        self.running.append(seq)
        out.scheduled.append((seq, num_new))
        return budget - min(cost, budget)

    # --------------------------------------------------------- after a step
    def update_from_output(self, out: SchedulerOutput) -> list[Sequence]:
        """Advance counters after the runner executed ``out``.

        Returns the sequences that reached the end of their tokens this step, i.e. those for
        which the runner sampled a token (appended by the engine afterwards).
        """
        ready = []
        for seq, num_new in out.scheduled:
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
            if seq.num_computed_tokens == seq.num_tokens:
                ready.append(seq)
        worked = {w.request_id for w in out.precompute}
        for seq in [s for s in self.precomputing if s.request_id in worked]:
            if not self.connector.get_precompute_work(seq):  # its documents are ready
                self.precomputing.remove(seq)
                seq.status = SequenceStatus.WAITING
                self.waiting.append(seq)
        return ready

    # -------------------------------------------------------------- helpers
    def _seconds_for_prefills(self) -> float:
        """The step's time budget for prefill and precompute: ``max_step_latency`` while some
        request decodes or more than one is running, waiting or precomputing (a stream between
        two of its requests decodes nothing for a moment, and its next prompt waits), when the
        cost model predicts; unbounded for a lone request (batch work keeps full-size steps)."""
        costs = self.step_costs
        if self.max_step_latency is None or costs is None or costs.coefficients is None:
            return math.inf
        decoding = any(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
        shared = decoding or len(self.running) + len(self.waiting) + len(self.precomputing) > 1
        return self.max_step_latency if shared else math.inf

    @staticmethod
    def _decode_work(out: SchedulerOutput) -> tuple[int, int]:
        """(rows, key rows) of the step's decode rows."""
        rows = [
            s.num_tokens
            for s, n in out.scheduled
            if n == 1 and s.num_computed_tokens + 1 == s.num_tokens
        ]
        return len(rows), sum(rows)

    def _num_seq_slots(self) -> int:
        """Running sequences plus the samples they will fork (a slot each, reserved)."""
        return len(self.running) + sum(len(seq.pending_children) for seq in self.running)

    def _fork(self, out: SchedulerOutput) -> None:
        """Fork the pending samples of every sequence whose prompt completes this step."""
        for seq, num_new in out.scheduled:
            children = seq.pending_children
            if not children or seq.num_computed_tokens + num_new < seq.num_tokens:
                continue
            assert seq.num_output_tokens == 0, "samples fork before the first output token"
            for child in children:
                assert child.status == SequenceStatus.WAITING and not child.block_table
                self.block_manager.fork(seq, child)
                # Its K/V is the parent's, computed this step; its first token is sampled
                # from the parent's last row (SchedulerOutput.forked).
                child.num_computed_tokens = seq.num_tokens
                child.status = SequenceStatus.RUNNING
                child.metrics.first_scheduled_time = seq.metrics.first_scheduled_time
                child.metrics.num_cached_tokens = seq.metrics.num_cached_tokens
            self.running.extend(children)
            out.forked[seq.request_id] = children
            seq.pending_children = []

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.last_piece_rows = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.block_manager.free(seq)
        seq.status = status
        seq.metrics.finished_time = time.perf_counter()


# A prefill piece the time budget would make smaller still gets this many rows, so a long
# prompt beside busy decodes always progresses.
MIN_PIECE_ROWS = 16


class _TimeBudget:
    """One step's seconds of predicted prefill and precompute work left (``math.inf``: no
    bound), and the work the step's batch takes on (what the engine records the step's time
    against)."""

    def __init__(self, seconds: float, costs: StepCostModel | None) -> None:
        self.left = seconds
        self.costs = costs
        self.batch = StepWork()
        self.progressed = False  # some prefill or precompute work is in the step

    def _seconds(self, work: StepWork) -> float:
        return self.costs.predict(work) or 0.0

    def fits(self, work: StepWork) -> bool:
        return math.isinf(self.left) or self._seconds(work) <= self.left

    def fits_whole(self, work: StepWork, prefills_scheduled: bool) -> bool:
        """Whether work that cannot be split (a fused prefill) runs now: it fits, or it could
        never fit a step's budget and goes first among the step's prefills (no starving)."""
        return self.fits(work) or not (self.progressed or prefills_scheduled)

    def rows(self, num_computed: int, most: int, last_piece: int) -> int:
        """The most prefill rows (up to ``most``) after ``num_computed`` that fit, at least
        :data:`MIN_PIECE_ROWS` and, under a time bound, at most twice ``last_piece`` (the
        sequence's previous piece): a size is measured before one twice as large runs, so a
        cost model that under-predicts large pieces costs one step, not a stall."""
        if math.isinf(self.left):
            return most
        most = min(most, max(MIN_PIECE_ROWS, 2 * last_piece))
        if self.fits(prefill_work(num_computed, most)):
            return most
        lo, hi = 0, most  # lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(prefill_work(num_computed, mid)):
                lo = mid
            else:
                hi = mid
        return max(lo, min(most, MIN_PIECE_ROWS))

    def take(self, work: StepWork, in_batch: bool = True) -> None:
        if in_batch:
            self.batch = self.batch + work
        if not math.isinf(self.left):
            self.left -= self._seconds(work)
        self.progressed = True
