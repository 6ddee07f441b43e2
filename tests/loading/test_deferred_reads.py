"""Deferred LMDB reads on the CPU (:mod:`blendkv.loading.layer_load`): chunks viewed in LMDB's
map are read by a thread while the full layer computes, with the same blocks and logits as
reading them before the forward; a value found corrupt then is computed in the forward."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import blend_llm

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.loading.layer_load import LayerwiseLoad
from blendkv.store.reader import ReadSnapshot

PROMPT = {"documents": DOCS, "query": QUERY}
ONE = SamplingParams(temperature=0.0, max_tokens=1)
# ProphetKV (the default: its query pass reads layer 0's K/V, so the reads are joined at once)
# and CacheBlend (a full layer 0 first: the reads run behind it)
BLENDS = {
    "prophet": BlendConfig(recompute_ratio=0.3),
    "cacheblend": BlendConfig(selection="v_deviation", recompute_ratio=0.3),
}


def _warm(llm, blend):
    """Compute and store every chunk, and read each once (its checksum checked)."""
    llm.generate([PROMPT], ONE, blend=blend)
    manager = llm.blend_manager()
    manager.flush()
    llm.generate([PROMPT], ONE, blend=blend)
    state = manager.prepare(PROMPT, blend)
    return manager, state, len(state.prompt.token_ids)


@pytest.fixture
def view_threads(monkeypatch):
    """Names of the threads that view LMDB values through a step's snapshot."""
    names: list[str] = []
    original = ReadSnapshot.view_encoded  # the loader reads values as stored

    def view(self, key):
        names.append(threading.current_thread().name)
        return original(self, key)

    monkeypatch.setattr(ReadSnapshot, "view_encoded", view)
    return names


@pytest.mark.parametrize("selection", list(BLENDS))
@pytest.mark.parametrize("pipelined", [False, True])
def test_deferred_reads_equal_reads_before_the_forward(
    tiny_llama_dir, tmp_path, view_threads, monkeypatch, pipelined, selection
):
    blend = BLENDS[selection]
    llm = blend_llm(tiny_llama_dir, tmp_path, pipelined)
    manager, _, n = _warm(llm, blend)
    loader = llm.engine.kv_connector._loader
    joined_at = []  # the layer whose wait joined the reads
    original_wait = LayerwiseLoad.wait

    def wait(self, layer):
        if not self._settled and layer >= self._deferred_from:
            joined_at.append(layer)
        return original_wait(self, layer)

    monkeypatch.setattr(LayerwiseLoad, "wait", wait)
    runs = {}
    for defer in (False, True):
        loader.read_mode = "deferred" if defer else "in_place"  # (kv_read_mode)
        view_threads.clear()
        out = llm.generate([PROMPT], ONE, blend=blend, logits_from=n - 3)[0]
        assert out.blend_stats.chunks_hit == len(DOCS) and out.blend_stats.chunks_missed == 0
        reader = "blendkv-kv-load" if pipelined else "blendkv-kv-read"
        expected = reader if defer else threading.current_thread().name
        assert view_threads == [expected] * len(DOCS)
        pool = torch.stack(llm.engine.runner.kv_caches).clone()
        runs[defer] = (out.extra["prompt_logits"], pool, out.blend_stats)
    assert joined_at == [0 if selection == "prophet" else 1]  # after the full layer 0
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])
    deferred, before = runs[True][2], runs[False][2]
    assert 0.0 <= deferred.read_hidden_seconds <= deferred.read_seconds
    assert before.read_hidden_seconds == 0.0
    assert deferred.kv_bytes_loaded == before.kv_bytes_loaded > 0
    assert manager.store._snapshots == []
    llm.close()


@pytest.mark.parametrize("selection", list(BLENDS))
@pytest.mark.parametrize("pipelined", [False, True])
def test_a_value_corrupted_after_the_lookup_is_computed_in_the_forward(
    tiny_llama_dir, tmp_path, view_threads, pipelined, selection
):
    """The index still lists the chunk, so the loader defers its read; the thread finds the
    header broken, and the forward computes the chunk before the first layer reads it: the
    same logits as from the intact store (precompute is deterministic), one chunk missed."""
    blend = BLENDS[selection]
    llm = blend_llm(tiny_llama_dir, tmp_path, pipelined)
    manager, state, n = _warm(llm, blend)
    intact = llm.generate([PROMPT], ONE, blend=blend, logits_from=n - 3)[0]
    store = manager.store
    key = state.chunk_keys[1]
    with store._env.begin(write=True, db=store._dbs["values"]) as txn:  # behind its back
        value = bytearray(txn.get(key))
        value[0] ^= 0x01  # the magic
        txn.put(key, bytes(value))
    view_threads.clear()
    out = llm.generate([PROMPT], ONE, blend=blend, logits_from=n - 3)[0]
    assert view_threads and threading.current_thread().name not in view_threads
    stats = out.blend_stats
    assert stats.chunks_missed == 1 and stats.chunks_hit == len(DOCS) - 1
    assert torch.equal(out.extra["prompt_logits"], intact.extra["prompt_logits"])
    assert store.corrupt >= 1 and store._snapshots == []
    manager.flush()  # the written-back copy replaces the corrupt value
    again = llm.generate([PROMPT], ONE, blend=blend, logits_from=n - 3)[0]
    assert again.blend_stats.chunks_hit == len(DOCS)
    assert torch.equal(again.extra["prompt_logits"], intact.extra["prompt_logits"])
    llm.close()
