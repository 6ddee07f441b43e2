"""Block manager rules with exact block ids, ref counts and free-queue order."""

from __future__ import annotations

import pytest

from blendkv.engine.block_manager import BlockManager, hash_block_tokens, hash_prefix_blocks
from blendkv.engine.sequence import Sequence
from blendkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, GREEDY, max_output_tokens=4)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a waiting sequence: take hits, allocate the rest."""
    blocks, num_cached = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - num_cached, blocks)
    seq.num_computed_tokens = num_cached
    return num_cached


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq, seq.num_computed_tokens)


def test_hash_is_stable_and_chained():
    h1 = hash_block_tokens(0, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(0, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(1, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(0, [1, 2, 3, 4], salt=b"blend")
    # A value fixed across processes and Python versions (xxh3-128 of a fixed encoding).
    assert hash_prefix_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [
        h1,
        hash_block_tokens(h1, [5, 6, 7, 8]),
    ]


def test_allocate_exact_ids_and_free_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(10)))
    assert admit(bm, a) == 0
    assert a.block_table == [0, 1, 2]
    assert list(bm.free_queue) == [3, 4, 5, 6, 7]
    run_prefill(bm, a)  # blocks 0, 1 full and hashed; block 2 partial
    assert bm.block_hash[0] is not None and bm.block_hash[1] is not None
    assert bm.block_hash[2] is None

    b = make_seq("b", list(range(8)) + [100, 101, 102])
    assert admit(bm, b) == 8
    # Its new block goes in the middle of the free run 3-7 (a, before it, may grow into 3, 4).
    assert b.block_table == [0, 1, 5]
    assert bm.ref_cnt[:6] == [2, 2, 1, 0, 0, 1]
    bm.check_integrity()

    bm.free(a)  # block 2 holds nothing reusable: head of the queue; 0 and 1 still used by b
    assert list(bm.free_queue) == [2, 3, 4, 6, 7]
    assert bm.ref_cnt[:6] == [1, 1, 0, 0, 0, 1]
    bm.free(b)  # freed back to front: 5 (unhashed) to the head, then 1, 0 to the tail
    assert list(bm.free_queue) == [5, 2, 3, 4, 6, 7, 1, 0]
    assert bm.num_cached_blocks == 2
    bm.check_integrity()


def test_prefix_hit_revives_free_cached_blocks_and_lazy_eviction():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    run_prefill(bm, a)
    bm.free(a)
    assert list(bm.free_queue) == [2, 3, 1, 0]

    c = make_seq("c", list(range(8)) + [50])  # same 8-token prefix: hits blocks 0 and 1
    assert admit(bm, c) == 8
    assert c.block_table == [0, 1, 2]
    assert list(bm.free_queue) == [3]
    bm.free(c)

    d = make_seq("d", [7] * 16)  # needs all 4 blocks: evicts the cached ones lazily
    assert admit(bm, d) == 0
    assert d.block_table == [2, 3, 1, 0]
    assert bm.num_cached_blocks == 0
    bm.check_integrity()


def test_last_token_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq("a", list(range(8)))
    admit(bm, a)
    run_prefill(bm, a)
    b = make_seq("b", list(range(8)))  # identical prompt: only the first block may hit
    assert admit(bm, b) == 4
    assert b.block_table == [0, 2]


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq("a", list(range(8)))
    admit(bm, a)
    big = make_seq("big", list(range(100, 110)))
    before = (list(bm.free_queue), list(bm.ref_cnt))
    assert not bm.allocate_slots(big, 10)
    assert (list(bm.free_queue), list(bm.ref_cnt)) == before
    assert big.block_table == []
    bm.check_integrity()


def test_copy_on_write_of_shared_partial_block():
    bm = BlockManager(num_blocks=6, block_size=4)
    parent = make_seq("p", list(range(6)))
    admit(bm, parent)
    run_prefill(bm, parent)
    child = make_seq("c", list(range(6)))
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and bm.ref_cnt[:2] == [2, 2]
    # The child's next token lands in block 1 (offset 2), shared: it must be copied first.
    assert bm.allocate_slots(child, 1)
    assert child.block_table == [0, 2]
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.ref_cnt[:3] == [2, 1, 1]
    # The parent now owns block 1 alone and writes in place.
    assert bm.allocate_slots(parent, 1)
    assert parent.block_table == [0, 1]
    assert bm.take_pending_copies() == []
    bm.check_integrity()
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 6
    bm.check_integrity()


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    run_prefill(bm, a)
    assert bm.num_cached_blocks == 0
    b = make_seq("b", list(range(9)))
    assert bm.get_computed_blocks(b) == ([], 0)


def test_cache_salt_separates_hashes():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq("a", list(range(9)))
    admit(bm, a)
    run_prefill(bm, a)
    b = make_seq("b", list(range(9)))
    b.cache_salt = b"blend:0.15"
    assert bm.get_computed_blocks(b) == ([], 0)


def test_integrity_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq("a", list(range(5)))
    admit(bm, a)
    bm.ref_cnt[0] += 1
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_tables_stay_in_runs_of_consecutive_blocks():
    """Placement keeps each table in few runs, so attention can slice the pool (no gather)."""
    bm = BlockManager(num_blocks=64, block_size=4)
    seqs = [make_seq(f"s{i}", list(range(i * 100, i * 100 + 10))) for i in range(4)]
    for seq in seqs:
        admit(bm, seq)
    # the first at the pool's start; each next one in the middle of the longest free run
    assert seqs[0].block_table == [0, 1, 2]
    assert seqs[1].block_table == [32, 33, 34]
    assert seqs[2].block_table == [16, 17, 18]
    assert seqs[3].block_table == [48, 49, 50]
    for _ in range(30):  # decode: every table grows into the blocks after it
        for seq in seqs:
            seq.append_token(7)
            seq.num_computed_tokens = seq.num_tokens - 1
            assert bm.allocate_slots(seq, 1)
    bm.check_integrity()
    for seq in seqs:
        table = seq.block_table
        assert len(table) == 10
        assert table == list(range(table[0], table[0] + len(table)))


def test_placement_never_takes_cached_blocks_out_of_eviction_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq("a", list(range(16)))
    admit(bm, a)
    run_prefill(bm, a)
    bm.free(a)  # blocks 0-3 cached (at the tail), 4 and 5 free and empty
    assert list(bm.free_queue) == [4, 5, 3, 2, 1, 0]
    b = make_seq("b", [9] * 12)  # 3 blocks: no run of 3 empty blocks, so the queue's head
    admit(bm, b)
    assert b.block_table == [4, 5, 3]  # 3 was the least recently used cached block
    assert bm.num_cached_blocks == 3
    bm.check_integrity()


def test_without_placement_blocks_come_from_the_queue_head():
    bm = BlockManager(num_blocks=8, block_size=4, place_in_runs=False)
    for rid, tokens in (("a", list(range(10))), ("b", list(range(8)) + [100, 101, 102])):
        seq = make_seq(rid, tokens)
        admit(bm, seq)
        run_prefill(bm, seq)
    assert seq.block_table == [0, 1, 3]  # b's hits, then the queue's head (not block 5)
    bm.check_integrity()
