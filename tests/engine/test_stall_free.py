"""No request stalls the others: while a request with many new documents and one
with a long prompt run, a running stream keeps getting tokens, a new short request starts
within a few steps, and aborting the documents' request stops its precompute and frees its
blocks (the chunks computed so far stay stored). Counted in engine steps, never in seconds."""

from __future__ import annotations

import pytest
from helpers import QuietLLM, make_tiny_model_dir

from blendkv import SamplingParams

N_DOCS = 150  # tiny documents, all new to the store
BUDGET = 64  # max_num_batched_tokens
LONG = 800  # tokens of the long prompt


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("long_model"), max_position_embeddings=8192)
    llm = QuietLLM(
        str(path),
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=BUDGET,
        kv_store_dir=str(tmp_path_factory.mktemp("store")),
    )
    yield llm
    llm.close()


def docs_prompt(tag: str) -> dict:
    docs = [f"{tag} fact {i}: box {i} is blue." for i in range(N_DOCS)]
    return {"documents": docs, "query": "Which box is blue?"}


def stream_params(max_tokens: int = 10_000) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def step_tokens(engine) -> dict[str, int]:
    """One step: request id -> number of output tokens so far, for those that got one."""
    return {out.request_id: len(out.outputs[0].token_ids) for out in engine.step()}


def test_a_stream_and_new_requests_keep_going_while_documents_precompute(llm):
    engine = llm.engine
    stream = engine.add_request("The quick brown fox", stream_params())
    while not step_tokens(engine).get(stream):
        pass
    big = engine.add_request(docs_prompt("run"), stream_params(4))
    long = engine.add_request([5 + i % 300 for i in range(LONG)], stream_params(4))
    assert engine.stats().num_precomputing == 1
    big_seq = engine.scheduler.precomputing[0]
    assert big_seq.request_id == big and not big_seq.block_table
    gaps, since, steps, short, short_wait = [], 0, 0, None, None
    first_token: dict[str, int] = {}
    while big not in first_token or long not in first_token:
        got = step_tokens(engine)
        steps += 1
        since = 0 if stream in got else since + 1
        gaps.append(since)
        for rid in got:
            first_token.setdefault(rid, steps)
        if steps == 5:
            short = engine.add_request("Paris is", stream_params(2))
        if short is not None and short_wait is None and short in got:
            short_wait = steps - 5
        assert steps < 2000, "the big requests never finished"
    # Every step ran the stream's decode, a new request's first token came at once, and the
    # documents really were spread over many steps (not computed inside one).
    assert max(gaps) == 0
    assert short_wait is not None and short_wait <= 2
    assert first_token[big] > 20
    engine.abort_request(stream)
    engine.abort_request(big)
    engine.abort_request(long)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_kv_blocks_used == 0


def test_aborting_the_documents_request_stops_its_precompute_and_frees_it(llm):
    engine = llm.engine
    manager = llm.blend_manager()
    stream = engine.add_request("The quick brown fox", stream_params())
    while not step_tokens(engine).get(stream):
        pass
    stream_seq = engine.requests[stream].seq
    big = engine.add_request(docs_prompt("abort"), stream_params(4))
    state = engine.kv_connector._states[big]
    keys = list(state.chunk_keys)
    for _ in range(10):
        step_tokens(engine)
    done = state.stats.chunks_missed
    assert 0 < done < N_DOCS
    assert engine.abort_request(big)
    assert engine.stats().num_precomputing == 0
    for _ in range(5):
        step_tokens(engine)
    assert state.stats.chunks_missed == done  # no precompute after the abort
    assert engine.stats().num_kv_blocks_used == len(stream_seq.block_table)  # the stream's
    manager.flush()
    assert sum(key in manager.store for key in keys) == done  # computed chunks are kept
    engine.abort_request(stream)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_kv_blocks_used == 0
    assert big_status_aborted(engine, big)


def big_status_aborted(engine, request_id: str) -> bool:
    return request_id not in engine.requests and not any(
        s.request_id == request_id for s in engine.scheduler.precomputing
    )


def test_the_documents_request_answers_as_if_its_chunks_were_stored(llm):
    """Precomputed over several steps or computed in the prefill: the same tokens."""
    engine = llm.engine
    prompt = {"documents": ["alpha beta gamma", "delta epsilon"], "query": "Which?"}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert first.blend_stats.chunks_missed == 2
    llm.blend_manager().flush()
    again = llm.generate([prompt], params)[0]
    assert again.blend_stats.chunks_missed == 0  # stored (or in the prefix cache) now
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.scheduler.precomputing == []
