"""Reading queued requests' chunks ahead of their step (:mod:`blendkv.loading.prefetch`).

Stores whose ``get`` / ``warm`` block until the test opens a gate stand in for slow storage (no
timing in the tests). The prefetcher reads each key once, holds what it read until released,
pauses at its byte budget and lets the loader take a key it has not started on; a request whose
reads are under way waits while a decode runs and is prefilled with what was read; and blends
with prefetched chunks give the logits of blends without, from LMDB and from Redis.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import BLEND_DOCS as DOCS
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.loading.prefetch import ChunkPrefetcher
from blendkv.store import KVStore
from blendkv.store.fingerprint import ModelFingerprint

FP = ModelFingerprint(
    architecture="LlamaForCausalLM",
    weights_hash="w" * 8,
    dtype="float32",
    tokenizer_hash="t" * 8,
    rope={"rope_theta": 10000.0, "rope_scaling": None},
    anchor_token_ids=(1,),
    num_layers=2,
    num_kv_heads=1,
    head_dim=4,
)
BLEND = BlendConfig(recompute_ratio=0.3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _until(condition, what: str) -> None:
    """Wait for a background thread's work (fails after a minute, never asserts on time)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


class GatedStore(KVStore):
    """An LMDB store whose reads by the prefetcher (``get_encoded``, ``warm``) wait for
    ``gate``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.started: list[bytes] = []

    def _wait(self, key: bytes) -> None:
        self.started.append(key)
        assert self.gate.wait(timeout=60), "the test never opened the gate"

    def get_encoded(self, key, **kwargs):
        if threading.current_thread().name == "blendkv-kv-prefetch":
            self._wait(key)
        return super().get_encoded(key, **kwargs)

    def warm(self, key):
        self._wait(key)
        return super().warm(key)


@pytest.fixture
def store(tmp_path):
    s = KVStore(tmp_path / "s", FP, memory_tier_bytes=0)
    for i in range(4):
        s.put(bytes([i]) * 16, torch.full((2, 2, 3, 1, 4), float(i)))
    yield s
    s.close()


def key(i: int) -> bytes:
    return bytes([i]) * 16


def test_each_key_is_read_once_and_held_until_every_request_released_it(store):
    p = ChunkPrefetcher(store, hold=True, max_bytes=1 << 20)
    p.submit("a", [key(0), key(1)])
    p.submit("b", [key(1), key(2)])
    _until(lambda: p.ready("a") and p.ready("b"), "the reads")
    assert p.num_read == 3 and p.num_failed == 0
    got = p.take(key(1))
    assert got is not None and torch.equal(got.kv, torch.full((2, 2, 3, 1, 4), 1.0))
    nbytes = got.kv.numel() * got.kv.element_size()
    assert p._held_bytes == 3 * nbytes
    p.release("a")
    assert p.take(key(0)) is None and p.take(key(1)) is not None
    assert p._held_bytes == 2 * nbytes
    p.release("b")
    assert p._held_bytes == 0 and not p._entries
    assert p.ready("a") and p.ready("unknown")
    p.close()


def test_the_loader_takes_a_key_not_started_and_waits_for_one_being_read(tmp_path):
    store = GatedStore(tmp_path / "g", FP, memory_tier_bytes=0)
    for i in range(2):
        store.put(key(i), torch.full((2, 2, 3, 1, 4), float(i)))
    p = ChunkPrefetcher(store, hold=True, max_bytes=1 << 20)
    p.submit("a", [key(0), key(1)])
    _until(lambda: store.started == [key(0)], "the first read")
    assert not p.ready("a")
    assert p.take(key(1)) is None  # withdrawn: the loader reads it itself
    assert not p.ready("a")  # key 0 is still being read
    taken = []
    taker = threading.Thread(target=lambda: taken.append(p.take(key(0))))
    taker.start()
    store.gate.set()
    taker.join(timeout=60)
    assert taken[0] is not None and torch.equal(taken[0].kv, torch.zeros(2, 2, 3, 1, 4))
    assert p.ready("a") and store.started == [key(0)]  # key 1 was never read here
    p.close()
    store.close()


def test_warm_ups_are_shared_with_the_step_unless_others_wait(tmp_path):
    """Page-cache warm-ups are never waited for; one not started stays with the thread (which
    reads it beside the step) until another request's keys queue behind it."""
    store = GatedStore(tmp_path / "g", FP, memory_tier_bytes=0)
    for i in range(3):
        store.put(key(i), torch.full((2, 2, 3, 1, 4), float(i)))
    p = ChunkPrefetcher(store, hold=False, max_bytes=1)
    p.submit("a", [key(0), key(1)])
    _until(lambda: store.started == [key(0)], "the first warm-up")
    assert p.take(key(0)) is None  # under way: not waited for
    assert p.take(key(1)) is None and p._entries[key(1)].status == "queued"  # left to the thread
    p.submit("b", [key(2)])
    assert p.take(key(1)) is None and p._entries[key(1)].status == "done"  # withdrawn now
    store.gate.set()
    _until(lambda: p.ready("a") and p.ready("b"), "the warm-ups")
    assert store.started == [key(0), key(2)]
    assert p.take(key(0)) is not None and p.take(key(0)).kv is None  # nothing held
    p.close()
    store.close()


def test_the_thread_pauses_at_its_byte_budget(store):
    p = ChunkPrefetcher(store, hold=True, max_bytes=1)  # one value fills it
    p.submit("a", [key(0)])
    p.submit("b", [key(1)])
    _until(lambda: p.ready("a"), "the first read")
    assert not p.ready("b") and p._entries[key(1)].status == "queued"
    p.release("a")
    _until(lambda: p.ready("b"), "the read after the release")
    assert p.take(key(1)) is not None
    p.close()


def test_warming_checks_the_checksum_once_and_leaves_corrupt_values(tmp_path):
    store = KVStore(tmp_path / "w", FP, memory_tier_bytes=0)
    store.put(key(0), torch.ones(2, 2, 3, 1, 4))
    store.put(key(1), torch.ones(2, 2, 3, 1, 4))
    assert store.warm(key(0)) and key(0) in store._verified
    with store._env.begin(write=True, db=store._dbs["values"]) as txn:  # behind its back
        value = bytearray(txn.get(key(1)))
        value[-1] ^= 0xFF  # the payload: only the checksum notices
        txn.put(key(1), bytes(value))
    assert not store.warm(key(1)) and key(1) not in store._verified
    assert not store.warm(key(3))  # a miss
    assert store.get(key(1)) is None and store.corrupt == 1  # the read that uses it reports it
    assert store._snapshots == []
    store.close()


def _prompts():
    """Two blended prompts over different chunks (two and one)."""
    return [
        {"documents": DOCS[:2], "query": "Which river runs past the alpha mill?"},
        {"documents": DOCS[2:], "query": "Which river runs past the delta mill?"},
    ]


def _run(llm, wait_for_reads: bool):
    """Queue both prompts, let their reads finish first (``wait_for_reads``), run them."""
    engine = llm.engine
    ids = [
        engine.add_request(p, GREEDY, blend=BLEND, logits_from=_query_start(llm, p))
        for p in _prompts()
    ]
    if wait_for_reads:
        conn = engine.kv_connector
        _until(lambda: all(conn.kv_ready(s) for s in engine.scheduler.waiting), "the reads")
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return [outs[i] for i in ids]


def _query_start(llm, prompt) -> int:
    return llm.blend_manager().prepare(prompt, BLEND).prompt.query_start


@pytest.mark.parametrize("where", ["lmdb", "redis"])
def test_prefetched_blends_equal_blends_read_in_their_step(
    tiny_llama_dir, tmp_path, where, request
):
    if where == "redis":
        server = request.getfixturevalue("redis_server")
        server.flush()
        location = server.url
    else:
        location = str(tmp_path / "store")
    results = {}
    for prefetch in (False, True):
        llm = QuietLLM(
            str(tiny_llama_dir),
            dtype="float32",
            block_size=4,
            enable_prefix_caching=False,
            kv_store_dir=location,
            kv_store_memory_bytes=1 << 20,  # Redis: the memory tier does not hold them all
            prefetch_kv=prefetch,
        )
        if not results:  # store every chunk first
            llm.generate(_prompts(), GREEDY, blend=BLEND)
            llm.blend_manager().flush()
        llm.blend_manager().store.memory_tier.clear()
        results[prefetch] = _run(llm, wait_for_reads=bool(prefetch))
        conn = llm.engine.kv_connector
        if prefetch:
            assert conn._prefetcher.hold == (where == "redis")
            assert conn._prefetcher._held_bytes == 0 and not conn._prefetcher._entries
        llm.close()
    for off, on in zip(results[False], results[True], strict=True):
        assert off.blend_stats.chunks_prefetched == 0
        n = on.blend_stats.num_chunks
        assert on.blend_stats.chunks_prefetched == on.blend_stats.chunks_hit == n
        assert on.blend_stats.chunks_missed == 0
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        assert torch.equal(on.extra["prompt_logits"], off.extra["prompt_logits"])


@pytest.mark.parametrize("spare_core", [False, True])
def test_by_default_lmdb_is_read_ahead_and_redis_with_a_spare_core(
    tiny_llama_dir, tmp_path, redis_server, monkeypatch, spare_core
):
    """On the CPU, warming LMDB pages (mostly waiting on the disk) is on; Redis reads (CPU work
    beside the forward) only where torch's threads leave a core free."""
    import blendkv.connector.blend_connector as connector

    monkeypatch.setattr(connector, "spare_cpu_core", lambda: spare_core)
    redis_server.flush()
    for location, expected in ((str(tmp_path / "s"), True), (redis_server.url, spare_core)):
        llm = QuietLLM(str(tiny_llama_dir), dtype="float32", kv_store_dir=location)
        llm.blend_manager()
        assert (llm.engine.kv_connector.prefetcher is not None) == expected
        llm.close()


def _gated_engine(path, tmp_path):
    """(engine on the tiny model, the first prompt, its reference output, the gated store
    holding the prompt's chunks, now the engine's store)."""
    llm = QuietLLM(str(path), dtype="float32", block_size=4, enable_prefix_caching=False)
    manager = llm.blend_manager()
    prompt = _prompts()[0]
    ref = llm.generate([prompt], GREEDY, blend=BLEND)[0]  # computes and stores its chunks
    manager.flush()
    gated = GatedStore(tmp_path / "gated", manager.fingerprint)
    for key_ in manager.prepare(prompt, BLEND).chunk_keys:
        gated.put(key_, manager.store.get(key_).kv.clone())
    manager.use_store(gated)
    return llm, prompt, ref, gated


def test_a_request_being_read_waits_while_a_decode_runs(tiny_llama_dir, tmp_path):
    llm, prompt, _, gated = _gated_engine(tiny_llama_dir, tmp_path)
    engine = llm.engine
    decode_id = engine.add_request(
        [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    )
    engine.step()
    blend_id = engine.add_request(prompt, GREEDY, blend=BLEND)
    for _ in range(5):  # its first chunk is being read: the decode steps alone
        outs = engine.step()
        assert [o.request_id for o in outs] == [decode_id]
        assert engine.stats().num_waiting == 1
    gated.gate.set()
    conn = engine.kv_connector
    _until(lambda: conn.kv_ready(engine.scheduler.waiting[0]), "the reads")
    stats = None
    for out in engine.step():
        if out.request_id == blend_id:
            stats = out.blend_stats
    assert stats is not None and stats.chunks_prefetched == stats.chunks_hit == 2
    engine.abort_request(decode_id)
    llm.close()


def test_nothing_else_to_run_schedules_a_request_being_read(tiny_llama_dir, tmp_path):
    """An idle engine does not wait for the reads. On the CPU the loader reads LMDB pages beside
    a warm-up under way and reads itself those the thread has not started on."""
    llm, prompt, ref, gated = _gated_engine(tiny_llama_dir, tmp_path)
    engine = llm.engine
    engine.add_request(prompt, GREEDY, blend=BLEND)
    _until(lambda: len(gated.started) == 1, "the first read")
    assert not engine.kv_connector.kv_ready(engine.scheduler.waiting[0])
    outs = engine.step()  # the gate stays shut: the thread is stuck in its first warm-up
    assert len(outs) == 1 and outs[0].blend_stats.chunks_hit == 2
    assert outs[0].blend_stats.chunks_prefetched == 0 and len(gated.started) == 1
    gated.gate.set()
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    llm.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1G"])
def test_a_bad_prefetch_budget_is_refused(bad):
    from blendkv.connector.config import BlendConnectorConfig
    from blendkv.errors import ConfigError

    with pytest.raises(ConfigError, match="prefetch_kv_bytes must be an integer > 0"):
        BlendConnectorConfig(prefetch_kv_bytes=bad)
    with pytest.raises(ConfigError, match="prefetch_kv must be None, True or False"):
        BlendConnectorConfig(prefetch_kv="yes")


def test_aborting_a_request_being_read_drops_what_was_read_for_it(store):
    """An aborted request's reads are dropped: one under way when it lands, the queued ones at
    once; a key another request still wants stays."""
    gated = threading.Event()

    class Gate:
        def __init__(self, inner) -> None:
            self.inner = inner

        def get_encoded(self, key):
            assert gated.wait(timeout=60)
            return self.inner.get_encoded(key)

    p = ChunkPrefetcher(Gate(store), hold=True, max_bytes=1 << 20)
    p.submit("a", [key(0), key(1), key(2)])
    p.submit("b", [key(2)])
    _until(lambda: p._entries[key(0)].status == "reading", "the first read")
    p.release("a")  # aborted while key 0 is read
    assert set(p._entries) == {key(0), key(2)}
    gated.set()
    _until(lambda: p.ready("b"), "b's read")
    assert set(p._entries) == {key(2)} and p.take(key(2)) is not None
    assert p.num_read == 2  # key 1 was never read
    p.release("b")
    assert p._held_bytes == 0 and not p._entries
    p.close()
