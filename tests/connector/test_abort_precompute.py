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


def test_an_abort_during_a_step_stops_its_precompute_at_the_next_chunk(tiny_llama_dir, tmp_path):
    """An idle engine runs all twelve documents' precompute in one step; an abort arriving
    from another thread after the first chunk stops it there, not after the step."""
    import asyncio

    from blendkv.entrypoints.async_llm import AsyncLLM

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", kv_store_dir=str(tmp_path / "store"))
    served = AsyncLLM.from_llm(llm)
    engine, manager = llm.engine, llm.blend_manager()
    prompt = {"documents": DOCS, "query": "Which answer is 35?"}
    keys = manager.prepare(prompt, None).chunk_keys
    connector, saved = engine.kv_connector, []
    save = connector.save_chunk_kv

    def save_then_abort(work, kv, seconds):  # on the engine thread, inside the step
        save(work, kv, seconds)
        saved.append(work.index)
        if len(saved) == 1:
            served.abort("docs")  # as the event loop would, on a disconnect

    connector.save_chunk_kv = save_then_abort

    async def run() -> None:
        await served.add_request(prompt, SamplingParams(max_tokens=1), "docs")
        while served.stats.num_aborted == 0:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    served.shutdown()
    assert len(saved) == 1 and not engine.has_unfinished_requests()
    manager.flush()
    assert sum(manager.has(key) for key in keys) == 1  # the computed chunk stays stored
    llm.close()
