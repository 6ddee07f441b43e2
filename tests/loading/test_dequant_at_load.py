"""Blending from int8 / int4 stores end to end (tiny model, float32): chunks stay encoded up to
the load kernel (dequantise at load), on every loading path, with the same bits on each; ratio 1.0
still equals full prefill (recomputed rows do not depend on stored K/V)."""

from __future__ import annotations

import pytest
import torch
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import blend_llm

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.eval.codecs import CodecStores
from blendkv.kernels.kv_dequant import EncodedChunk
from blendkv.loading.layer_load import LayerwiseLoad

PROMPT = {"documents": DOCS, "query": QUERY}
ONE = SamplingParams(temperature=0.0, max_tokens=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def loaded(monkeypatch):
    """The chunk values each step hands the load kernels."""
    seen = []
    original = LayerwiseLoad.start

    def start(self):
        seen.extend(type(w.kv) for w in self.writes if w.fetch is None)
        return original(self)

    monkeypatch.setattr(LayerwiseLoad, "start", start)
    return seen


def _logits(llm, blend, n):
    """The last rows' logits and the pool's first 64 blocks (the request's: the pool is 1 GB)."""
    out = llm.generate([PROMPT], ONE, blend=blend, logits_from=n - 3)[0]
    assert out.blend_stats.chunks_hit == len(DOCS)
    pool = torch.stack([c[:, :64] for c in llm.engine.runner.kv_caches]).clone()
    assert pool.abs().sum() > 0
    return out.extra["prompt_logits"], pool


def test_int8_store_at_ratio_one_equals_full_prefill(tiny_llama_dir, tmp_path, loaded):
    llm = blend_llm(tiny_llama_dir, tmp_path, None)
    blend = BlendConfig(recompute_ratio=1.0)
    stores = CodecStores(llm.blend_manager(), ["none", "int8"])
    state = llm.blend_manager().prepare(PROMPT, blend)
    start = state.prompt.query_start
    with stores.use("int8"):
        llm.generate([PROMPT], ONE, blend=blend)  # computes the chunks, writes them encoded
        loaded.clear()
        out = llm.generate([PROMPT], GREEDY, blend=blend, logits_from=start)[0]
    assert out.blend_stats.chunks_hit == len(DOCS)
    full = llm.generate([state.prompt.token_ids], GREEDY, logits_from=start)[0]
    torch.testing.assert_close(
        out.extra["prompt_logits"], full.extra["prompt_logits"], atol=1e-5, rtol=0
    )
    assert out.outputs[0].token_ids == full.outputs[0].token_ids
    stores.close()
    llm.close()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_every_loading_path_writes_the_same_decoded_bits(tiny_llama_dir, tmp_path, codec, loaded):
    """Reuse (ratio 0: the stored K/V is all there is) and (int4) the default blend from an
    encoded store: pipelined and serial, LMDB views read behind the forward or before it, and copies
    through the memory tier give the same logits and pool; near ``none``'s, not equal."""
    results = {}
    for ratio in (0.0, None) if codec == "int4" else (0.0,):
        blend = BlendConfig() if ratio is None else BlendConfig(recompute_ratio=ratio)
        runs = {}
        for pipelined in (False, True):
            llm = blend_llm(tiny_llama_dir, tmp_path / f"{codec}{ratio}{pipelined}", pipelined)
            manager = llm.blend_manager()
            stores = CodecStores(manager, ["none", codec])
            n = len(manager.prepare(PROMPT, blend).prompt.token_ids)
            loader = llm.engine.kv_connector._loader
            llm.generate([PROMPT], ONE, blend=blend)  # warm the none store
            runs["none", pipelined] = _logits(llm, blend, n)
            with stores.use(codec):
                llm.generate([PROMPT], ONE, blend=blend)  # warm the codec's store
                # in the store, encoded: a chunk still in the background writer is read as
                # computed (raw bits), which a slow writer (a busy machine) left to the next run
                manager.flush()
                for mode, read_mode in {
                    "deferred view": "deferred",
                    "view": "in_place",
                    "memory tier": "copy",
                }.items():
                    loader.read_mode = read_mode  # (BlendConnectorConfig.kv_read_mode)
                    loaded.clear()
                    runs[mode, pipelined] = _logits(llm, blend, n)
                    if read_mode != "deferred":
                        assert loaded and all(t is EncodedChunk for t in loaded), loaded
            stores.close()
            llm.close()
        base = runs["memory tier", False]
        for key, (logits, pool) in runs.items():
            if key[0] != "none":
                assert torch.equal(logits, base[0]) and torch.equal(pool, base[1]), key
        none = runs["none", False][0]
        assert torch.equal(runs["none", True][0], none)
        results[ratio] = (base[0] - none).abs().max().item()
    assert 0 < results[0.0] < 0.5, results  # decoded K/V: close to the raw K/V's, not equal
