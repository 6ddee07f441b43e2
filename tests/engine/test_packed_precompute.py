"""Chunk precompute packed into one forward (:mod:`blendkv.engine.chunk_packing`): with
``deterministic=True`` (row-tiled GEMMs), or where a probe of the engine's own forward finds
packing exact. Each chunk's K/V is bit-identical to the chunk computed alone, and a step's new
small documents take one forward, not one each."""

from __future__ import annotations

import pytest
import torch
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.engine.chunk_packing import PACK_ROWS, PROBED_PACK_ROWS, pack

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
    assert runner.pack_rows == PACK_ROWS
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


@pytest.fixture(params=["auto", "mkl"])
def default_llm(tiny_llama_dir, request):
    """The default engine, and one on MKL's GEMMs (packed weights for 17-32 rows, as on Intel
    CPUs: a row's bits then depend on the row count, and the probe finds packing inexact on
    the development CPU)."""
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", cpu_gemm=request.param)
    yield llm
    llm.close()


def test_without_row_tiles_a_probe_decides_once(default_llm, monkeypatch):
    """Without row tiles the engine probes at its first computation of several chunks. Where
    packing is exact (oneDNN's float32 GEMMs on the development CPU) chunks share forwards and
    get the bits they get alone, from any context; where it is not, each runs alone. One chunk
    never probes."""
    runner, tok = default_llm.engine.runner, default_llm.tokenizer
    assert runner.pack_rows is None
    anchor = tok.encode("Answer from the notes.")
    runner.compute_chunk_kv([anchor], [tok.encode(DOCS[0])])
    assert runner.pack_rows is None
    runner.compute_chunk_kv([anchor] * 2, [tok.encode(d) for d in DOCS[:2]])  # the probe
    assert runner.pack_rows in (0, PROBED_PACK_ROWS)
    chunks = [tok.encode(d) for d in DOCS]
    contexts = [anchor, anchor[:3], [], *([anchor] * (len(chunks) - 3))]
    forwards = _Forwards(runner)
    monkeypatch.setattr(runner, "_chunk_forward", forwards)
    packed = runner.compute_chunk_kv(contexts, chunks)
    if runner.pack_rows == 0:
        assert forwards.calls == [1] * len(chunks)
        return
    assert sum(forwards.calls) == len(chunks) and len(forwards.calls) < len(chunks) / 2
    alone = _alone(runner, contexts, chunks)
    for i, (p, a) in enumerate(zip(packed, alone, strict=True)):
        assert torch.equal(p, a), f"chunk {i} differs when packed"


def test_a_forward_whose_rows_round_by_batch_is_not_packed(default_llm, monkeypatch):
    """A platform where a row's bits depend on the forward's width (injected: packed outputs
    off by one ulp-sized step) fails the probe; every chunk then runs alone."""
    runner, tok = default_llm.engine.runner, default_llm.tokenizer
    real = runner._chunk_forward

    def rounding_by_width(pairs):
        outs = real(pairs)
        return [o + 1e-6 for o in outs] if len(pairs) > 1 else outs

    forwards = _Forwards(runner)
    forwards._real = rounding_by_width
    monkeypatch.setattr(runner, "_chunk_forward", forwards)
    runner.compute_chunk_kv([[]] * 4, [tok.encode(d) for d in DOCS[:4]])
    assert runner.pack_rows == 0
    assert forwards.calls[-4:] == [1, 1, 1, 1]


def test_pack_groups_in_order_within_the_rows():
    assert pack([3, 4, 5, 9, 1], 9) == [[0, 1], [2], [3], [4]]
    assert pack([3, 4], 0) == [[0], [1]]
    assert pack([], 9) == []
