"""Scheduler rules for connector precompute (a request's new documents): spread over steps
under the token budget after decodes and prefills, the request PRECOMPUTING with no blocks
until its last item ran, oversized items alone, abort anywhere. Pure Python, exact ids."""

from __future__ import annotations

from blendkv.engine.block_manager import BlockManager
from blendkv.engine.kv_connector import KVConnectorBase
from blendkv.engine.scheduler import Scheduler
from blendkv.engine.scheduler_output import PrecomputeWork
from blendkv.engine.sequence import Sequence, SequenceStatus
from blendkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def make(rid, n, max_out=8, start=0):
    return Sequence(rid, list(range(start, start + n)), GREEDY, max_output_tokens=max_out)


class WorkConnector(KVConnectorBase):
    """Precompute items per request (costs in tokens); the runner's part marks them done."""

    def __init__(self, work: dict[str, list[int]]) -> None:
        super().__init__(None)
        self.todo = {rid: dict(enumerate(costs)) for rid, costs in work.items()}
        self.ran: list[tuple[str, int]] = []

    def get_precompute_work(self, seq):
        rid = seq.request_id
        return [
            PrecomputeWork(rid, i, (), tuple(range(cost)))
            for i, cost in sorted(self.todo.get(rid, {}).items())
        ]

    def save_chunk_kv(self, work, kv, seconds):
        assert self.todo[work.request_id].pop(work.index) == work.num_tokens
        self.ran.append((work.request_id, work.index))


def step(sched: Scheduler):
    """Schedule, run the precompute, pretend the forward ran, append a token where sampled."""
    out = sched.schedule()
    for work in out.precompute:  # the runner's forward, stood in for
        sched.connector.save_chunk_kv(work, None, 0.0)
    for seq in sched.update_from_output(out):
        seq.append_token(7)
        if seq.num_output_tokens >= seq.max_output_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    sched.block_manager.check_integrity()
    return out


def ids(out):
    return [(s.request_id, n) for s, n in out.scheduled]


def work(out):
    return [(w.request_id, w.index) for w in out.precompute]


def test_precompute_fills_the_budget_left_after_decodes_and_prefills():
    conn = WorkConnector({"docs": [6] * 10})
    sched = Scheduler(
        BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16, connector=conn
    )
    a = make("a", 5, max_out=50)
    sched.add(a)
    step(sched)  # a prefills
    docs = make("docs", 9, start=100)
    sched.add(docs)
    assert docs.status == SequenceStatus.PRECOMPUTING and list(sched.precomputing) == [docs]
    assert not sched.waiting
    out = step(sched)
    # a decodes (1), then two 6-token items fit in 15; the third waits (no passing).
    assert ids(out) == [("a", 1)] and work(out) == [("docs", 0), ("docs", 1)]
    assert not docs.block_table and docs.status == SequenceStatus.PRECOMPUTING
    b = make("b", 8, start=200)
    sched.add(b)
    out = step(sched)
    # A new short request is admitted before the precompute gets the rest.
    assert ids(out) == [("a", 1), ("b", 8)] and work(out) == [("docs", 2)]
    steps = 0
    while docs.status == SequenceStatus.PRECOMPUTING:
        out = step(sched)
        assert ("a", 1) in ids(out)  # the stream decodes every step
        assert out.num_batched_tokens + out.num_precompute_tokens <= 16
        steps += 1
    assert steps == 4 and len(conn.ran) == 10  # 7 items left, two a step (b decodes too)
    assert docs.status == SequenceStatus.WAITING and list(sched.waiting) == [docs]
    out = step(sched)
    assert ("docs", 9) in ids(out) and docs.block_table  # admitted: a plain prefill now


def test_an_item_larger_than_the_budget_runs_alone_among_prefills():
    conn = WorkConnector({"big": [40, 3]})
    sched = Scheduler(
        BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16, connector=conn
    )
    a = make("a", 12)
    sched.add(a)
    sched.add(make("big", 4, start=100))
    out = step(sched)  # a's prefill takes 12: the oversized item waits for a step without one
    assert ids(out) == [("a", 12)] and work(out) == []
    out = step(sched)  # a decodes: the big item goes, over the budget, with nothing else
    assert ids(out) == [("a", 1)] and work(out) == [("big", 0)]
    out = step(sched)
    assert work(out) == [("big", 1)]


def test_abort_while_precomputing_drops_the_request_and_its_work():
    conn = WorkConnector({"docs": [4] * 20})
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8, connector=conn)
    docs = make("docs", 9)
    sched.add(docs)
    step(sched)
    assert sched.abort("docs") is docs
    assert docs.status == SequenceStatus.FINISHED_ABORTED
    assert not sched.has_unfinished()
    out = step(sched)
    assert out.is_empty and len(conn.ran) == 2


def test_a_request_without_work_is_queued_as_before():
    conn = WorkConnector({})
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8, connector=conn)
    a = make("a", 3)
    sched.add(a)
    assert list(sched.waiting) == [a] and a.status == SequenceStatus.WAITING


def test_a_long_prefill_leaves_half_the_budget_to_waiting_requests():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    long = make("long", 100)
    sched.add(long)
    out = sched.schedule()
    sched.update_from_output(out)
    assert ids(out) == [("long", 16)]  # alone: the whole budget
    short = make("short", 3, start=500)
    sched.add(short)
    out = sched.schedule()
    sched.update_from_output(out)
    assert ids(out) == [("long", 8), ("short", 3)]  # admitted at once, not after 6 more steps
