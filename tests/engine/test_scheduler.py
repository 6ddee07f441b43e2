"""Scheduler rules: budgets, chunked prefill, preemption, abort, and a random workload."""

from __future__ import annotations

import random

from blendkv.engine.block_manager import BlockManager
from blendkv.engine.kv_connector import KVConnectorBase
from blendkv.engine.scheduler import Scheduler
from blendkv.engine.sequence import Sequence, SequenceStatus
from blendkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def make(rid, n, max_out=8, start=0):
    return Sequence(rid, list(range(start, start + n)), GREEDY, max_output_tokens=max_out)


def step(sched: Scheduler, token: int = 7):
    """Schedule, pretend the runner ran, append a token to every sequence that sampled."""
    out = sched.schedule()
    ready = sched.update_from_output(out)
    for seq in ready:
        seq.append_token(token)
        if seq.num_output_tokens >= seq.max_output_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    sched.block_manager.check_integrity()
    return out, ready


def test_prefill_and_decode_share_a_step():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=32)
    a = make("a", 5)
    sched.add(a)
    out, _ = step(sched)
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 5)]
    b = make("b", 6, start=100)
    sched.add(b)
    out, ready = step(sched)
    # a decodes one token while b prefills in the same flattened batch.
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 6)]
    assert ready == [a, b]


class ReadingConnector(KVConnectorBase):
    """A connector still reading the K/V of the requests in ``reading``."""

    def __init__(self) -> None:
        super().__init__(None)
        self.reading: set[str] = set()

    def kv_ready(self, seq) -> bool:
        return seq.request_id not in self.reading


def test_requests_being_read_let_others_pass_while_work_runs():
    conn = ReadingConnector()
    sched = Scheduler(
        BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64, connector=conn
    )
    a, b, c = make("a", 5), make("b", 6, start=100), make("c", 4, start=200)
    sched.add(a)
    step(sched)  # a runs
    conn.reading = {"b"}
    sched.add(b)
    sched.add(c)
    out, _ = step(sched)
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("c", 4)]
    assert list(sched.waiting) == [b] and b.status == SequenceStatus.WAITING
    conn.reading = set()
    out, _ = step(sched)
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("c", 1), ("b", 6)]


def test_a_request_being_read_runs_when_nothing_else_would():
    conn = ReadingConnector()
    sched = Scheduler(
        BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64, connector=conn
    )
    a, b = make("a", 5), make("b", 6, start=100)
    conn.reading = {"a", "b"}
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)  # the head goes; b waits behind the now running a
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 5)]
    assert list(sched.waiting) == [b]


def test_chunked_prefill_respects_token_budget():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a = make("a", 20)
    sched.add(a)
    chunks = []
    while a.num_output_tokens == 0:
        out, _ = step(sched)
        chunks.append(out.scheduled[0][1])
    assert chunks == [8, 8, 4]
    assert a.num_computed_tokens == 20


def test_no_chunking_waits_for_budget():
    sched = Scheduler(
        BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=8, enable_chunked_prefill=False
    )
    a, b = make("a", 6), make("b", 6, start=50)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert [s.request_id for s, _ in out.scheduled] == ["a"]  # b (6) does not fit in 2 left


def test_max_num_seqs():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(make(str(i), 3, start=10 * i))
    out, _ = step(sched)
    assert [s.request_id for s, _ in out.scheduled] == ["0", "1"]
    assert len(sched.waiting) == 1


def test_preemption_by_recompute_frees_latest_and_resumes():
    # 4 blocks of 4 tokens. Two sequences of 7 tokens take 2 blocks each; when both need a
    # third block for decoding, the later one is preempted and recomputed afterwards.
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make("a", 7, max_out=3), make("b", 7, max_out=3, start=50)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefill: positions 0..6, 1 output each -> 8 tokens
    out, _ = step(sched)  # both decode position 7: fits in block 1
    assert not out.preempted
    out, _ = step(sched)  # position 8 needs a new block each: only... none free -> preempt b
    assert out.preempted == [b]
    assert [s.request_id for s, _ in out.scheduled] == ["a"]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert a.is_finished  # a reached max_out=3
    out, _ = step(sched)  # b recomputes prompt + its 2 outputs (9 tokens) as a prefill,
    # minus its first block, still cached from before the preemption
    assert out.scheduled == [(b, 5)] and b.num_computed_tokens == 9
    assert b.metrics.num_preemptions == 1
    while sched.has_unfinished():
        step(sched)
    assert sched.block_manager.num_free_blocks == 4


def test_abort_waiting_and_running():
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=1, max_num_batched_tokens=64)
    a, b = make("a", 5), make("b", 5, start=9)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.abort("b") is b and b.status == SequenceStatus.FINISHED_ABORTED
    assert sched.abort("a") is a and a.block_table == []
    assert sched.abort("zzz") is None
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 8


def test_random_workload_keeps_integrity():
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=24, block_size=4)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=24)
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    next_id, preemptions, finished = 0, 0, 0
    for _ in range(400):
        if rng.random() < 0.3:
            tokens = rng.choice(prefixes)[: rng.randrange(0, 9)]
            tokens = tokens + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            sched.add(Sequence(str(next_id), tokens, GREEDY, rng.randrange(1, 12)))
            next_id += 1
        if rng.random() < 0.05 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        out, _ = step(sched, token=rng.randrange(1000))
        preemptions += len(out.preempted)
        for seq, n in out.scheduled:
            assert n > 0 and seq.num_computed_tokens <= seq.num_tokens
            assert seq.is_finished or len(seq.block_table) * 4 >= seq.num_computed_tokens
        assert out.num_batched_tokens <= 24 and len(sched.running) <= 6
    while sched.has_unfinished():
        step(sched, token=rng.randrange(1000))
        finished += 1
    assert preemptions > 0, "the workload should exercise preemption"
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()
