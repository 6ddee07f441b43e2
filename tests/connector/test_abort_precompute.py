"""Aborting a request while its new documents are precomputed: the work stops at the next
step, and the chunks computed so far stay stored for whoever sends them next."""

from __future__ import annotations

from helpers import QuietLLM

from blendkv import SamplingParams

DOCS = [f"Document {i} says that the answer to question {i} is {i * 7}." for i in range(12)]


def test_abort_stops_precompute_and_keeps_what_was_computed(tiny_llama_dir, tmp_path):
    # a small token budget: a few chunks a step
    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        kv_store_dir=str(tmp_path / "store"),
        max_num_batched_tokens=64,
    )
    engine, manager = llm.engine, llm.blend_manager()
    prompt = {"documents": DOCS, "query": "Which answer is 21?"}
    keys = manager.prepare(prompt, None).chunk_keys
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2))

    def stored() -> list[int]:
        manager.flush()
        return [i for i, key in enumerate(keys) if manager.has(key)]

    for _ in range(3):
        engine.step()
    done = stored()
    assert 0 < len(done) < len(DOCS)
    assert engine.stats().num_precomputing == 1
    assert engine.abort_request(rid)
    assert engine.stats().num_precomputing == 0 and not engine.has_unfinished_requests()
    assert engine.step() == [] and stored() == done  # no more of its work ran
    # a later request with the same documents reads them and computes only the rest
    again = llm.generate([prompt], SamplingParams(max_tokens=1))[0].blend_stats
    assert again.chunks_hit == len(done) and again.chunks_missed == len(DOCS) - len(done)
    llm.close()


def test_an_abort_during_a_step_stops_its_precompute_at_the_next_forward(tiny_llama_dir, tmp_path):
    """An idle engine runs all the documents' precompute in one step, in forwards of one chunk
    or of several (where packing is exact, :mod:`blendkv.engine.chunk_packing`). An abort
    arriving from another thread while the first forward's chunks are saved stops it there,
    not after the step; the chunks that forward computed stay stored."""
    import asyncio

    from blendkv.entrypoints.async_llm import AsyncLLM

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", kv_store_dir=str(tmp_path / "store"))
    served = AsyncLLM.from_llm(llm)
    engine, manager, runner = llm.engine, llm.blend_manager(), llm.engine.runner
    docs = DOCS * 2  # more rows than one packed forward holds
    prompt = {"documents": [f"{d} ({i})" for i, d in enumerate(docs)], "query": "Which is 35?"}
    keys = manager.prepare(prompt, None).chunk_keys
    runner.compute_chunk_kv([[]] * 2, [[5, 6], [7, 8]])  # the packing probe, out of the way
    connector, saved, forwards = engine.kv_connector, [], []
    save, forward = connector.save_chunk_kv, runner._chunk_forward

    def save_then_abort(work, kv, seconds):  # on the engine thread, inside the step
        save(work, kv, seconds)
        saved.append(work.index)
        if len(saved) == 1:
            served.abort("docs")  # as the event loop would, on a disconnect

    def counted_forward(pairs):
        forwards.append(len(pairs))
        return forward(pairs)

    connector.save_chunk_kv, runner._chunk_forward = save_then_abort, counted_forward

    async def run() -> None:
        await served.add_request(prompt, SamplingParams(max_tokens=1), "docs")
        while served.stats.num_aborted == 0:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    served.shutdown()
    assert len(forwards) == 1 and forwards[0] < len(docs)  # no forward after the abort
    assert len(saved) == forwards[0] and not engine.has_unfinished_requests()
    manager.flush()
    assert sum(manager.has(key) for key in keys) == forwards[0]  # what it computed stays
    llm.close()
