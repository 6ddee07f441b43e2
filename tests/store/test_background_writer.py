"""Chunk K/V computed at query time is stored off the engine step (store/writer.py).

A store whose ``put_many`` blocks until the test opens a gate stands in for a slow disk (no
timing in the test): a decode running beside a blended request with ten missing chunks keeps
stepping while those writes are pending, and every chunk is in the store after ``flush`` and
after shutdown.
"""

from __future__ import annotations

import threading

import torch
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.store import KVStore

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet".split()
DOCS = [f"Document {w}: the {w} river runs past the {w} mill." for w in WORDS]


class SlowStore(KVStore):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.writes_started = threading.Event()
        self.gate = threading.Event()

    def put_many(self, chunks):
        self.writes_started.set()
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super().put_many(chunks)


def test_decode_keeps_stepping_while_writes_are_pending(tiny_llama_dir, tmp_path):
    store_dir = tmp_path / "store"
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4, enable_prefix_caching=False)
    manager = llm.blend_manager()
    slow = SlowStore(store_dir, manager.fingerprint)
    manager.use_store(slow)
    engine = llm.engine
    decode_id = engine.add_request(
        [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    prompt = {"documents": DOCS, "query": "Which river runs past the golf mill?"}
    state = manager.prepare(prompt, BlendConfig())
    blend_id = engine.add_request(
        prompt, SamplingParams(temperature=0.0, max_tokens=2), blend=BlendConfig()
    )
    stats = None
    for _ in range(5):  # its 10 missed documents' precompute step(s), then its fused prefill
        for out in engine.step():
            if out.request_id == blend_id:
                stats = out.blend_stats
        if stats is not None:
            break
    assert stats is not None and stats.chunks_missed == 10
    assert manager.writer.num_pending > 0  # handed over, not written inside the step
    assert slow.writes_started.wait(timeout=60)  # the writer thread is inside put_many
    decode_steps_while_pending = 0
    for _ in range(20):
        outs = engine.step()
        if manager.writer.num_pending == 10 and any(o.request_id == decode_id for o in outs):
            decode_steps_while_pending += 1
    assert decode_steps_while_pending == 20
    slow.gate.set()
    manager.flush()
    assert all(key in slow for key in state.chunk_keys)
    engine.abort_request(decode_id)
    llm.close()


def test_shutdown_flushes_pending_writes(tiny_llama_dir, tmp_path):
    store_dir = tmp_path / "store"
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4, kv_store_dir=str(store_dir))
    manager = llm.blend_manager()
    fingerprint = manager.fingerprint
    prompt = {"documents": DOCS[:4], "query": "Which mill?"}
    keys = manager.prepare(prompt, None).chunk_keys
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.blend_stats.chunks_missed == 4
    stored_kv = manager.writer.pending(keys[0])
    stored_kv = None if stored_kv is None else stored_kv.clone()
    llm.close()  # flushes the writer before closing the store
    with KVStore(store_dir, fingerprint) as store:
        assert all(key in store for key in keys)
        if stored_kv is not None:
            assert torch.equal(store.get(keys[0]).kv, stored_kv)


def test_a_second_request_reads_pending_chunks_instead_of_recomputing(tiny_llama_dir, tmp_path):
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4, enable_prefix_caching=False)
    manager = llm.blend_manager()
    slow = SlowStore(tmp_path / "store", manager.fingerprint)
    manager.use_store(slow)
    prompt = {"documents": DOCS[:3], "query": "Which mill?"}
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    first = llm.generate([prompt], greedy)[0]
    assert manager.writer.num_pending == 3  # the write is held at the gate
    second = llm.generate([prompt], greedy)[0]
    slow.gate.set()
    assert first.blend_stats.chunks_missed == 3
    assert second.blend_stats.chunks_hit == 3 and second.blend_stats.chunks_missed == 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    llm.close()


def test_a_script_that_never_closes_still_writes_its_chunks(tiny_llama_dir, tmp_path):
    import json
    import subprocess
    import sys

    store_dir = tmp_path / "store"
    script = f"""
import json, time
from blendkv import LLM, SamplingParams
from blendkv.store import KVStore

class SlowStore(KVStore):  # the write is still going on when the script ends
    def put_many(self, chunks):
        time.sleep(1.0)
        return super().put_many(chunks)

llm = LLM({str(tiny_llama_dir)!r}, dtype="float32", block_size=4, warmup=False)
prompt = {{"documents": {DOCS[:3]!r}, "query": "Which mill?"}}
m = llm.blend_manager()
m.use_store(SlowStore({str(store_dir)!r}, m.fingerprint))
out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
assert out.blend_stats.chunks_missed == 3
print(json.dumps([k.hex() for k in m.prepare(prompt, None).chunk_keys]))
print(json.dumps(m.fingerprint.to_dict()))
"""  # no llm.close(): the writer's exit handler must flush
    done = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    keys_line, fp_line = done.stdout.decode().strip().splitlines()[-2:]
    from blendkv.store import ModelFingerprint

    fp = json.loads(fp_line)
    fingerprint = ModelFingerprint(**{**fp, "anchor_token_ids": tuple(fp["anchor_token_ids"])})
    with KVStore(store_dir, fingerprint) as store:
        assert all(bytes.fromhex(k) in store for k in json.loads(keys_line))
