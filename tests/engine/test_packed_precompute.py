"""Chunk precompute packed into one forward (``ModelRunner.pack_chunks``, on with
``deterministic=True``): each chunk's K/V is bit-identical to the chunk computed alone, and a
step's new small documents take one forward, not one each."""

from __future__ import annotations

import pytest
import torch
from helpers import QuietLLM

from blendkv import SamplingParams

DOCS = [f"Note {i}: the locker {i} holds {i * 3} blue boxes and a key." for i in range(12)]


@pytest.fixture(scope="module")
def det_llm(tiny_llama_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("packed") / "store"
    llm = QuietLLM(
        str(tiny_llama_dir), dtype="float32", deterministic=True, kv_store_dir=str(store)
    )
    yield llm
    llm.close()


class _Forwards:
    """Counts the runner's chunk forwards (and still runs them)."""

    def __init__(self, runner) -> None:
        self.runner, self.calls = runner, []
        self._real = runner._chunk_forward

    def __call__(self, pairs):
        self.calls.append(len(pairs))
        return self._real(pairs)


def _alone(runner, contexts, chunks):
    return [runner._chunk_forward([(c, k)])[0] for c, k in zip(contexts, chunks, strict=True)]


def test_packed_chunks_equal_chunks_alone_bit_for_bit(det_llm, monkeypatch):
    runner = det_llm.engine.runner
    assert runner.pack_chunks
    tok = det_llm.tokenizer
    anchor = tok.encode("Answer from the notes.")
    chunks = [tok.encode(d) for d in DOCS]
    contexts = [anchor, anchor[:3], [], *([anchor] * (len(chunks) - 3))]  # different lengths
    forwards = _Forwards(runner)
    monkeypatch.setattr(runner, "_chunk_forward", forwards)
    packed = runner.compute_chunk_kv(contexts, chunks)
    assert forwards.calls == [len(chunks)]  # one forward for all
    alone = _alone(runner, contexts, chunks)
    assert len(forwards.calls) == 1 + len(chunks)
    for i, (p, a) in enumerate(zip(packed, alone, strict=True)):
        assert p.shape == a.shape == (3, 2, len(chunks[i]), 2, 16)
        assert torch.equal(p, a), f"chunk {i} differs when packed"


def test_a_steps_new_documents_take_one_forward_and_are_stored_as_alone(det_llm, monkeypatch):
    runner, manager = det_llm.engine.runner, det_llm.blend_manager()
    prompt = {"documents": DOCS, "query": "Which locker holds 9 boxes?"}
    state = manager.prepare(prompt, None)
    forwards = _Forwards(runner)
    monkeypatch.setattr(runner, "_chunk_forward", forwards)
    stats = det_llm.generate([prompt], SamplingParams(max_tokens=2))[0].blend_stats
    assert stats.chunks_missed == len(DOCS)
    assert len(forwards.calls) < len(DOCS) and sum(forwards.calls) == len(DOCS)
    manager.flush()
    stored = [manager.document_store.get(key).kv for key in state.chunk_keys]
    alone = _alone(runner, state.chunk_contexts, state.prompt.chunks)
    for i, (s, a) in enumerate(zip(stored, alone, strict=True)):
        assert torch.equal(s, a.to(s.dtype)), f"stored chunk {i} differs from it alone"


def test_without_row_tiles_each_chunk_runs_alone(tiny_llama_dir, monkeypatch):
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32")
    runner = llm.engine.runner
    assert not runner.pack_chunks
    forwards = _Forwards(runner)
    monkeypatch.setattr(runner, "_chunk_forward", forwards)
    chunks = [llm.tokenizer.encode(d) for d in DOCS[:4]]
    runner.compute_chunk_kv([[]] * 4, chunks)
    assert forwards.calls == [1, 1, 1, 1]
    llm.close()
