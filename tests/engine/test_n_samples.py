"""``SamplingParams.n > 1``: samples fork from one computed prompt and share its KV blocks.

Against transformers' ``generate``: greedy samples all equal its greedy output, and seeded sample
i equals ``generate`` after ``torch.manual_seed(seed + i)`` (vLLM's child-seed convention), with
and without a penalty. The block counts are asserted exactly, on the pure scheduler and through
the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
import torch
import transformers
from helpers import BLEND_DOCS, BLEND_QUERY, QuietLLM, blend_llm

from blendkv import LLM, SamplingParams
from blendkv.engine.block_manager import BlockManager
from blendkv.engine.parallel_sampling import child_sampling_params
from blendkv.engine.scheduler import Scheduler
from blendkv.engine.sequence import Sequence, SequenceStatus
from blendkv.errors import InvalidSamplingParamsError

VOCAB = 320
MAX_TOKENS = 12


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(length)]


def hf_generate(hf, ids: list[int], seed: int | None = None, **kwargs) -> list[int]:
    x = torch.tensor([ids])
    if seed is not None:
        torch.manual_seed(seed)
    out = hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=MAX_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
        top_k=0,
        top_p=1.0,
        **kwargs,
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # No prefix cache, as on the RAG path: sharing comes from the fork alone.
    return QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4, enable_prefix_caching=False)


def all_free(llm: LLM) -> bool:
    llm.engine.check_integrity()
    bm = llm.engine.block_manager
    return not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


# ------------------------------------------------------------- scheduler, exact blocks
def group(prompt_len: int, n: int, block_size: int = 4) -> tuple[Sequence, list[Sequence]]:
    params = SamplingParams(n=n)
    seqs = [
        Sequence(f"s{i}", list(range(prompt_len)), child_sampling_params(params, i), 8)
        for i in range(n)
    ]
    seqs[0].pending_children = seqs[1:]
    return seqs[0], seqs[1:]


def decode_step(sched: Scheduler, out, seqs: list[Sequence], token: int) -> None:
    sched.update_from_output(out)
    for seq in seqs:
        seq.append_token(token)


@pytest.mark.parametrize(("prompt_len", "num_copies"), [(41, 3), (40, 0)])
def test_fork_shares_prompt_blocks_and_copies_only_the_partial_tail(prompt_len, num_copies):
    bm = BlockManager(64, 4, enable_prefix_caching=False, place_in_runs=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    parent, children = group(prompt_len, 4)
    sched.add(parent)
    out = sched.schedule()
    prompt_blocks = -(-prompt_len // 4)
    assert [s for s, _ in out.scheduled] == [parent]  # the prompt runs once
    assert out.forked == {"s0": children} and not parent.pending_children
    assert all(c.block_table == parent.block_table for c in children)
    assert all(bm.ref_cnt[b] == 4 for b in parent.block_table)
    assert bm.num_blocks - bm.num_free_blocks == prompt_blocks
    assert all(c.status == SequenceStatus.RUNNING for c in children)
    assert all(c.num_computed_tokens == prompt_len for c in children)

    decode_step(sched, out, [parent, *children], token=7)
    out = sched.schedule()
    assert [(s, n) for s, n in out.scheduled] == [(s, 1) for s in (parent, *children)]
    # Full prompt blocks stay shared; each sample has its own last block (copied when shared).
    full = prompt_len // 4
    assert bm.num_blocks - bm.num_free_blocks == full + 4
    assert len(out.blocks_to_copy) == num_copies
    assert all(c.block_table[:full] == parent.block_table[:full] for c in children)
    assert len({s.block_table[-1] for s in (parent, *children)}) == 4
    bm.check_integrity()
    for seq in (parent, *children):
        sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    assert bm.num_free_blocks == bm.num_blocks


def test_samples_reserve_their_max_num_seqs_slots_at_admission():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=256)
    other = Sequence("other", [1, 2, 3], SamplingParams(), 8)
    parent, children = group(9, 4)
    sched.add(other)
    sched.add(parent)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [other]  # 1 + 4 slots > 4: the group waits
    sched.finish(other, SequenceStatus.FINISHED_LENGTH)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [parent] and out.forked["s0"] == children
    assert len(sched.running) == 4


def test_chunked_prompt_forks_when_its_last_piece_runs():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    parent, children = group(30, 3)
    sched.add(parent)
    out = sched.schedule()
    assert out.scheduled == [(parent, 16)] and not out.forked
    sched.update_from_output(out)
    out = sched.schedule()
    assert out.scheduled == [(parent, 14)] and out.forked["s0"] == children
    assert bm.num_blocks - bm.num_free_blocks == 8


# -------------------------------------------------------------- against transformers
def test_greedy_samples_all_equal_transformers_greedy(llm, hf):
    ps = [prompt(n, seed) for seed, n in enumerate((5, 23, 41))]
    params = SamplingParams(temperature=0.0, n=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(ps, params)
    for p, out in zip(ps, outs, strict=True):
        ref = hf_generate(hf, p, do_sample=False)
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [ref] * 3
        assert [c.finish_reason for c in out.outputs] == ["length"] * 3
    assert all_free(llm)


@pytest.mark.parametrize("penalty", [1.0, 1.4])
def test_seeded_sample_i_equals_transformers_with_seed_plus_i(llm, hf, penalty):
    p = prompt(19, seed=4)
    params = SamplingParams(
        temperature=0.8,
        seed=100,
        n=4,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        repetition_penalty=penalty,
    )
    out = llm.generate([p], params)[0]
    refs = [
        hf_generate(
            hf, p, seed=100 + i, do_sample=True, temperature=0.8, repetition_penalty=penalty
        )
        for i in range(4)
    ]
    assert len(set(map(tuple, refs))) == 4, "distinct samples, or the test proves little"
    assert [c.token_ids for c in out.outputs] == refs
    # And sample i equals a single request with seed + i.
    singles = llm.generate([p] * 4, [child_sampling_params(params, i) for i in range(4)])
    assert [s.outputs[0].token_ids for s in singles] == refs
    assert all_free(llm)


def test_engine_block_counts_prompt_once_plus_a_tail_per_sample(llm):
    engine = llm.engine
    bm = engine.block_manager
    p = prompt(41, seed=5)  # 10 full blocks of 4 and one partial
    params = SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=5, ignore_eos=True)
    engine.add_request(p, params)
    engine.step()  # the prompt, once; four first tokens
    assert bm.num_blocks - bm.num_free_blocks == 11
    engine.step()  # every sample writes its own last block
    assert bm.num_blocks - bm.num_free_blocks == 10 + 4  # not 4 * 11
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert all_free(llm)


# ------------------------------------------------------ streams, stops, abort, preemption
def test_stream_deltas_and_finish_reasons_per_sample(llm):
    p = prompt(13, seed=6)
    base = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=MAX_TOKENS, ignore_eos=True)
    free = [c.token_ids for c in llm.generate([p], base)[0].outputs]
    stop_id = free[1][2]  # sample 1 stops after 3 tokens, the others where they meet it
    params = SamplingParams(
        temperature=1.0, seed=7, n=4, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id]
    )
    texts = [""] * 4
    outs = list(llm.stream(p, params))
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        for c in out.outputs:
            texts[c.index] += c.delta_text
        assert out.delta_text == out.outputs[0].delta_text
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    final = outs[-1].outputs
    assert texts == [c.text for c in final]
    for c, tokens in zip(final, free, strict=True):
        cut = tokens.index(stop_id) + 1 if stop_id in tokens else len(tokens)
        assert c.token_ids == tokens[:cut]
        assert c.finish_reason == ("stop" if stop_id in tokens else "length")
    assert final[1].finish_reason == "stop" and len(final[1].token_ids) == 3
    # Sample 1 finished early; later outputs still list it, with nothing new.
    assert any(o.outputs[1].finish_reason == "stop" and not o.finished for o in outs)
    assert all_free(llm)


def test_abort_ends_every_sample_and_frees_their_blocks(llm):
    params = SamplingParams(temperature=1.0, n=3, max_tokens=50, ignore_eos=True)
    stream = llm.stream(prompt(22, seed=8), params)
    first = next(stream)
    assert len(first.outputs) == 3 and not first.finished
    stream.close()  # closing a stream aborts its request
    assert all_free(llm)
    engine = llm.engine
    rid = engine.add_request(prompt(9), params)  # aborted before its samples forked
    assert engine.abort_request(rid) and not engine.abort_request(rid)
    assert all_free(llm) and not engine.parents and not engine.requests


def test_preempted_samples_recompute_and_match_transformers(tiny_llama_dir, hf):
    # 12 blocks of 4 tokens: four samples of 10 + 12 tokens (2 shared blocks, 4 own each)
    # cannot all stay resident.
    small = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=12,
        enable_prefix_caching=False,
    )
    p = prompt(10, seed=9)
    params = SamplingParams(temperature=0.0, n=4, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = small.generate([p], params)[0]
    assert out.metrics.num_preemptions > 0
    ref = hf_generate(hf, p, do_sample=False)
    assert [c.token_ids for c in out.outputs] == [ref] * 4
    assert all_free(small)
    small.close()


def test_n_above_max_num_seqs_is_a_typed_error(tiny_llama_dir):
    narrow = QuietLLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=2)
    with pytest.raises(InvalidSamplingParamsError, match="max_num_seqs"):
        narrow.generate([[5, 6, 7]], SamplingParams(n=3))
    narrow.close()


def test_blended_prompt_is_blended_once_for_all_samples(tiny_llama_dir, tmp_path):
    blend = blend_llm(tiny_llama_dir, tmp_path, pipelined=None)
    doc_prompt = {"documents": BLEND_DOCS, "query": BLEND_QUERY}
    params = SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=8, ignore_eos=True)
    blend.generate([doc_prompt], SamplingParams(max_tokens=1))  # stores the chunks
    out = blend.generate([doc_prompt], params)[0]
    assert out.blend_stats is not None and out.blend_stats.chunks_hit == len(BLEND_DOCS)
    singles = [blend.generate([doc_prompt], child_sampling_params(params, i))[0] for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    assert all_free(blend)
    blend.close()


def test_async_llm_streams_every_sample_and_abort_ends_them(tiny_llama_dir, llm):
    from blendkv.entrypoints.async_llm import AsyncLLM

    p = prompt(15, seed=10)
    params = SamplingParams(temperature=1.0, seed=21, n=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = [c.text for c in llm.generate([p], params)[0].outputs]
    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", block_size=4)

    async def collect() -> list:
        return [out async for out in engine.generate(p, params)]

    async def abort_early() -> None:
        stream = engine.generate(p, dataclasses.replace(params, max_tokens=200))
        async for _ in stream:
            break  # leaving the loop closes the stream: every sample is aborted
        await stream.aclose()

    try:
        outs = asyncio.run(asyncio.wait_for(collect(), timeout=60))
        texts = [""] * 3
        for out in outs:
            for c in out.outputs:
                texts[c.index] += c.delta_text
        assert texts == ref == [c.text for c in outs[-1].outputs] and outs[-1].finished
        asyncio.run(asyncio.wait_for(abort_early(), timeout=60))
        bm = engine.llm.engine.block_manager
        assert wait_until(lambda: bm.num_free_blocks == bm.num_blocks)
    finally:
        engine.shutdown()


def wait_until(ready, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
