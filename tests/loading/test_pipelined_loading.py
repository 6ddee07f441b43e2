"""Layer-wise pipelined loading and the loading controller inside the engine."""

from __future__ import annotations

import pytest
import torch
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import blend_llm

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.errors import ConfigError
from blendkv.loading.controller import LoadingController

PROMPT = {"documents": DOCS, "query": QUERY}
ONE = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_pipelined_equals_serial_bit_for_bit(tiny_llama_dir, tmp_path, ratio):
    """The same blocks and the same logits whether layers are written behind the forward or
    before it (the store is warmed first, so both read every chunk from it)."""
    blend = BlendConfig(recompute_ratio=ratio)
    runs = {}
    for pipelined in (False, True):
        llm = blend_llm(tiny_llama_dir, tmp_path / str(pipelined), pipelined)
        llm.generate([PROMPT], ONE, blend=blend)  # warm the store
        n = len(llm.blend_manager().prepare(PROMPT, blend).prompt.token_ids)
        out = llm.generate([PROMPT], ONE, blend=blend, logits_from=n - 3)[0]
        assert out.blend_stats.chunks_hit == len(DOCS)
        pool = torch.stack(llm.engine.runner.kv_caches).clone()
        runs[pipelined] = (out.extra["prompt_logits"], pool, out.blend_stats)
        llm.close()
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])
    stats = runs[True][2]
    assert 0.0 <= stats.load_hidden_seconds <= stats.load_seconds
    serial = runs[False][2]  # its writes run before the forward; its LMDB reads behind it
    assert serial.load_hidden_seconds == serial.read_hidden_seconds
    assert 0.0 <= serial.read_hidden_seconds <= serial.read_seconds


@pytest.mark.parametrize("pipelined", [False, True])
def test_lmdb_chunks_are_viewed_through_a_step_snapshot(tiny_llama_dir, tmp_path, pipelined):
    """On the CPU, stored chunks are read in place from LMDB's map (the loading thread reads
    each layer there): the same logits as from memory-tier copies, nothing copied into the
    memory tier, and the snapshot closed when the step ends."""
    blend = BlendConfig(recompute_ratio=0.3)
    llm = blend_llm(tiny_llama_dir, tmp_path, pipelined)
    llm.generate([PROMPT], ONE, blend=blend)  # computes the chunks and writes them back
    manager = llm.blend_manager()
    manager.flush()
    store = manager.store
    state = manager.prepare(PROMPT, blend)
    n = len(state.prompt.token_ids)

    def run():
        return llm.generate([PROMPT], ONE, blend=blend, logits_from=n - 3)[0]

    lmdb_hits = store.lmdb_hits
    from_lmdb = run()
    assert from_lmdb.blend_stats.chunks_hit == len(DOCS)
    assert store.lmdb_hits - lmdb_hits == len(DOCS)
    assert len(store.memory_tier) == 0 and store._snapshots == []
    for key in state.chunk_keys:  # get() copies each chunk into the memory tier
        store.get(key)
    memory_hits, lmdb_hits = store.memory_tier.hits, store.lmdb_hits
    from_memory = run()
    assert store.memory_tier.hits - memory_hits == len(DOCS)
    assert store.lmdb_hits == lmdb_hits
    assert torch.equal(from_lmdb.extra["prompt_logits"], from_memory.extra["prompt_logits"])
    llm.close()


def test_a_failing_layer_write_fails_the_step_and_the_engine_recovers(tiny_llama_dir, tmp_path):
    llm = blend_llm(tiny_llama_dir, tmp_path, pipelined=True)
    blend = BlendConfig(recompute_ratio=0.3)
    expected = llm.generate([PROMPT], ONE, blend=blend)[0].outputs[0].token_ids
    kernels = llm.engine.blend_kernels
    original = kernels.load_rotated_kv

    def broken(kv_caches, first_layer, *args):
        if first_layer == 2:
            raise RuntimeError("disk on fire")
        return original(kv_caches, first_layer, *args)

    kernels.load_rotated_kv = broken
    with pytest.raises(RuntimeError, match="disk on fire"):
        llm.generate([PROMPT], ONE, blend=blend)
    kernels.load_rotated_kv = original
    again = llm.generate([PROMPT], ONE, blend=blend)[0].outputs[0].token_ids
    assert again == expected
    llm.close()


def test_auto_ratio_follows_the_controller(tiny_llama_dir, tmp_path):
    llm = blend_llm(tiny_llama_dir, tmp_path, pipelined=True)
    # skip_exact off: the prompt's first chunk is exact, and the cap must reach every chunk
    auto = BlendConfig(
        recompute_ratio="auto", min_recompute_ratio=0.1, max_recompute_ratio=0.8, skip_exact=False
    )
    llm.generate([PROMPT], ONE, blend=auto)  # warm the store
    conn = llm.engine.kv_connector

    conn.controller = conn._loader.controller = LoadingController()  # nothing measured
    first = llm.generate([PROMPT], ONE, blend=auto)[0].blend_stats
    assert first.chosen_recompute_ratio == 0.1  # the floor
    assert conn.controller.compute.value is not None  # the step was measured

    slow = LoadingController()  # fake measurements: storage far slower than compute
    slow.record_load("memory", 1000, 1.0)
    slow.record_load("lmdb", 1000, 1.0)
    slow.record_compute(10**6, 1.0)
    conn.controller = conn._loader.controller = slow
    second = llm.generate([PROMPT], ONE, blend=auto)[0].blend_stats
    assert second.chosen_recompute_ratio == 0.8  # the cap: recompute hides behind loading
    assert second.recompute_fraction == pytest.approx(0.8, abs=0.02)
    conn.pipelined = False  # written before the forward: nothing hides the recompute
    third = llm.generate([PROMPT], ONE, blend=auto)[0].blend_stats
    assert third.chosen_recompute_ratio == 0.1
    llm.close()


def test_auto_ratio_bounds_are_checked():
    with pytest.raises(ConfigError, match="must not exceed"):
        BlendConfig(recompute_ratio="auto", min_recompute_ratio=0.5, max_recompute_ratio=0.2)
    with pytest.raises(ConfigError, match="or 'auto'"):
        BlendConfig(recompute_ratio="most")
    assert BlendConfig(recompute_ratio="auto").planned_ratio == 0.5


@pytest.mark.parametrize("num_layers", [1, 2, 3, 24, 30, 32])
def test_cuda_load_stages_cover_every_layer_once_in_doubling_steps(num_layers):
    from blendkv.engine.kv_connector import load_stages

    stages = load_stages(num_layers)
    layers = [layer for lo, hi in stages for layer in range(lo, hi)]
    assert layers == list(range(num_layers))
    sizes = [hi - lo for lo, hi in stages]
    assert sizes[0] == 1 and all(b == 2 * a for a, b in zip(sizes, sizes[1:-1], strict=False))
    assert len(stages) == num_layers.bit_length()  # ~log2: a few launches per chunk


def test_default_pipelines_on_the_cpu_only_with_a_spare_core(monkeypatch):
    """``pipeline_kv_load=None``: the loading thread runs only when torch's threads leave a
    core free; True and False are kept as given; anything else is refused."""
    from blendkv.connector.config import BlendConnectorConfig
    from blendkv.kernels.blend_kernels import BlendKernels
    from blendkv.kernels.torch_attention import TorchAttentionBackend
    from blendkv.loading import layer_load

    pool = [torch.zeros(2, 2, 4, 1, 8)]
    write = layer_load.ChunkWrite(torch.zeros(1, 2, 3, 1, 8), 0, torch.arange(3), torch.arange(3))

    def resolved(setting, threads, cores):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        monkeypatch.setattr(layer_load.os, "sched_getaffinity", lambda pid: set(range(cores)))
        tables = (torch.ones(8, 8), torch.zeros(8, 8))
        kernels = BlendKernels(TorchAttentionBackend("cpu"))
        return layer_load.LayerwiseLoad(kernels, pool, tables, [write], setting).pipelined

    assert resolved(None, threads=2, cores=2) is False
    assert resolved(None, threads=2, cores=4) is True
    assert resolved(True, threads=2, cores=2) is True
    assert resolved(False, threads=1, cores=4) is False
    assert BlendConnectorConfig().pipeline_kv_load is None
    with pytest.raises(ConfigError, match="pipeline_kv_load"):
        BlendConnectorConfig(pipeline_kv_load="yes")
