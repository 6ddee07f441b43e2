"""The device tier (``kv_device_cache_bytes``): chunk K/V kept in device memory after a request
loaded it, read before every other tier by the next.

On the CPU the "device" is the host, so these check what the tier keeps and serves and that the
answers do not change; what it saves (the host-to-device copy) only a GPU shows.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.connector.config import BlendConnectorConfig
from blendkv.errors import ConfigError
from blendkv.guards.cost_check import request_shape

PROMPT = {"documents": DOCS, "query": QUERY}
ONE = SamplingParams(temperature=0.0, max_tokens=1)
BLEND = BlendConfig(recompute_ratio=0.3)


def make_llm(path, store, device_cache_bytes=0, pipelined=None):
    return QuietLLM(
        str(path),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,  # the same prompt again: loaded again, not prefix hits
        kv_store_dir=str(store),
        kv_device_cache_bytes=device_cache_bytes,
        pipeline_kv_load=pipelined,
    )


def loader_of(llm):
    llm.blend_manager()  # (the loader is made with the manager)
    return llm.engine.kv_connector._loader


def run(llm, n):
    out = llm.generate([PROMPT], ONE, blend=BLEND, logits_from=n - 3)[0]
    return out.extra["prompt_logits"], out.blend_stats


def test_chunks_are_served_from_the_device_tier_with_the_same_logits(tiny_llama_dir, tmp_path):
    """A store warmed by one engine, read by a fresh one: the first request reads every chunk
    from the store and copies it into the tier as it loads; the second reads them all from
    the tier. Both give the logits of an engine without the tier."""
    warm = make_llm(tiny_llama_dir, tmp_path / "store")
    n = len(warm.blend_manager().prepare(PROMPT, BLEND).prompt.token_ids)
    want, _ = run(warm, n)  # computes the chunks, writes them back
    want, _ = run(warm, n)  # read from the store
    warm.close()

    llm = make_llm(tiny_llama_dir, tmp_path / "store", device_cache_bytes=64 << 20)
    loader = loader_of(llm)
    loader.read_mode = "copy"  # (CPU: LMDB chunks are otherwise views read later)
    first, stats = run(llm, n)
    assert stats.chunks_hit == len(DOCS) and stats.chunks_on_device == 0
    assert len(loader.device_tier) == len(DOCS)
    for _, value in loader.device_tier._entries.items():  # copies, not the store's buffers
        assert value._base is None and value.is_contiguous()
    second, stats = run(llm, n)
    assert stats.chunks_hit == stats.chunks_on_device == len(DOCS)
    assert stats.chunks_missed == 0
    assert torch.equal(first, want) and torch.equal(second, want)
    conn = llm.engine.kv_connector
    assert "device" in conn.controller.bandwidth  # its own measured rate
    # the cost check predicts the load from the tier the loader reads
    state = llm.blend_manager().prepare(PROMPT, BLEND)
    shape = request_shape(state, llm.blend_manager(), conn.controller, loader.device_tier)
    assert list(shape.reused_by_tier) == ["device"]
    llm.close()


def test_computed_chunks_are_kept_as_computed(tiny_llama_dir, tmp_path):
    llm = make_llm(tiny_llama_dir, tmp_path / "store", device_cache_bytes=64 << 20)
    n = len(llm.blend_manager().prepare(PROMPT, BLEND).prompt.token_ids)
    first, stats = run(llm, n)
    assert stats.chunks_missed == len(DOCS)
    loader = loader_of(llm)
    assert len(loader.device_tier) == len(DOCS)
    second, stats = run(llm, n)
    assert stats.chunks_on_device == len(DOCS)
    torch.testing.assert_close(second, first, atol=1e-5, rtol=1e-5)
    llm.close()


def test_the_budget_bounds_the_tier(tiny_llama_dir, tmp_path):
    """Chunks past the budget evict the least recently used; a chunk larger than the whole
    budget is never copied."""
    llm = make_llm(tiny_llama_dir, tmp_path / "store", device_cache_bytes=64 << 20)
    n = len(llm.blend_manager().prepare(PROMPT, BLEND).prompt.token_ids)
    run(llm, n)
    tier = loader_of(llm).device_tier
    sizes = sorted(v.numel() * v.element_size() for v in tier._entries.values())
    llm.close()

    llm = make_llm(tiny_llama_dir, tmp_path / "store", device_cache_bytes=sizes[-1] + sizes[-2])
    loader = loader_of(llm)
    loader.read_mode = "copy"
    run(llm, n)
    assert 1 <= len(loader.device_tier) <= 2 and loader.device_tier.nbytes <= sizes[-1] + sizes[-2]
    llm.close()

    llm = make_llm(tiny_llama_dir, tmp_path / "store", device_cache_bytes=sizes[0] - 1)
    loader = loader_of(llm)
    loader.read_mode = "copy"
    _, stats = run(llm, n)
    assert len(loader.device_tier) == 0 and stats.chunks_hit == len(DOCS)
    llm.close()


def test_a_write_cut_short_is_not_kept(tiny_llama_dir, tmp_path, monkeypatch):
    """A step whose writes failed part-way: the chunk copied whole is kept, the one whose
    write failed is not (the next request would read layers never written)."""
    from blendkv.loading import layer_load

    warm = make_llm(tiny_llama_dir, tmp_path / "store")
    n = len(warm.blend_manager().prepare(PROMPT, BLEND).prompt.token_ids)
    want, _ = run(warm, n)
    warm.close()
    llm = make_llm(tiny_llama_dir, tmp_path / "store", 64 << 20, pipelined=False)  # in order
    loader = loader_of(llm)
    loader.read_mode = "copy"
    original = layer_load.LayerwiseLoad._write
    calls = []

    def failing(self, w, layer, count):
        calls.append(layer)
        if len(calls) == 2:
            w.device_copy[layer : layer + count].copy_(w.kv[layer : layer + count])
            w.copied_layers += count - 1  # one layer short, like a write that stopped
            raise OSError("device lost")
        original(self, w, layer, count)

    monkeypatch.setattr(layer_load.LayerwiseLoad, "_write", failing)
    with pytest.raises(OSError, match="device lost"):
        llm.generate([PROMPT], ONE, blend=BLEND)
    assert len(loader.device_tier) == 1 and loader._keep == []
    monkeypatch.setattr(layer_load.LayerwiseLoad, "_write", original)
    got, stats = run(llm, n)
    assert stats.chunks_on_device == 1 and torch.equal(got, want)
    llm.close()


def test_bad_budgets_are_refused():
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(ConfigError, match="kv_device_cache_bytes"):
            BlendConnectorConfig(kv_device_cache_bytes=bad)
