"""The request cache: K/V of documents sent in prompts goes to a bounded private store, read
after the main store and never written into it; without a store, the private store is bounded,
and the bound holds for its file on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.store.kv_store import KVStore
from blendkv.store.layered import LayeredKVStore

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0, max_tokens=2)
ENGINE = dict(dtype="float32", block_size=4, enable_prefix_caching=False)


def _prompts(n: int, start: int = 0) -> list[dict]:
    return [
        {"documents": [f"Document number {i} says the code is {i * 7}."], "query": "The code?"}
        for i in range(start, start + n)
    ]


def test_request_documents_never_reach_the_store_and_the_cache_stays_bounded(
    tiny_llama_dir, tmp_path
):
    store = tmp_path / "store"
    with QuietLLM(str(tiny_llama_dir), kv_store_dir=str(store), **ENGINE) as llm:
        manager = llm.blend_manager()
        first = llm.generate(_prompts(1), GREEDY)[0].text  # one chunk: its size sets the bound
        manager.flush()
        chunk_bytes = manager.store.stats().bytes
        assert chunk_bytes > 0  # without a request cache, documents land in the store
        manager.document_store.delete([m.key for m in manager.document_store.iter_meta()])
        bound = 3 * chunk_bytes + chunk_bytes // 2  # room for 3 chunks
        manager.use_request_cache(bound)
        assert isinstance(manager.store, LayeredKVStore)
        cache = manager.store.cache
        peak = 0
        for prompt in _prompts(8):  # more documents than fit
            llm.generate([prompt], GREEDY)
            manager.flush()
            peak = max(peak, cache.stats().bytes)
        assert len(manager.document_store) == 0  # nothing written into the store
        assert 0 < peak <= bound and cache.stats().entries == 3 and cache.stats().evictions == 5
        assert llm.generate(_prompts(1), GREEDY)[0].text == first  # evicted: recomputed
        hit = llm.generate(_prompts(1), GREEDY)[0]  # now cached again: read from the cache
        assert hit.text == first and hit.blend_stats.chunks_hit == 1
    with KVStore(store, readonly=True) as s:
        assert len(s) == 0


def test_private_store_is_bounded(tiny_llama_dir):
    with QuietLLM(str(tiny_llama_dir), request_cache_bytes=1 << 16, **ENGINE) as llm:
        manager = llm.blend_manager()
        assert not isinstance(manager.store, LayeredKVStore)  # the private store is the cache
        for prompt in _prompts(12):
            llm.generate([prompt], GREEDY)
        manager.flush()
        stats = manager.store.stats()
        assert stats.max_bytes == 1 << 16 and 0 < stats.bytes <= 1 << 16 and stats.evictions > 0


def test_the_cache_file_on_disk_stays_within_its_bound(tiny_llama_dir):
    """Real chunk K/V (the tiny model's, 768 bytes a token), six times the bound in all: the
    LMDB file, not only the values in it, stays within the bound, and the bound is used."""
    bound = 3 << 19  # 1.5 MiB
    with QuietLLM(str(tiny_llama_dir), **ENGINE) as llm:
        manager = llm.blend_manager()
        manager.use_request_cache(bound)  # as the server does (--request-cache-bytes)
        data = Path(manager.store.path) / "data.mdb"
        sizes = []
        for i in range(16):
            docs = [_long_document(3 * i + j) for j in range(3)]
            llm.generate([{"documents": docs, "query": "The code?"}], GREEDY)
            manager.flush()
            sizes.append(os.path.getsize(data))
            if i == 0:
                chunk_bytes = manager.store.stats().bytes // 3
        stats = manager.store.stats()
        assert stats.entries + stats.evictions == 48 and 48 * chunk_bytes > 5 * bound
        assert max(sizes) <= bound
        assert stats.bytes >= bound // 2 and stats.max_bytes == bound


def _long_document(i: int) -> str:
    """About 245 tokens of the tiny tokenizer (190 KB of K/V)."""
    words = " ".join(f"item{i}x{j}" for j in range(30))
    return f"Document {i} lists {words}."
