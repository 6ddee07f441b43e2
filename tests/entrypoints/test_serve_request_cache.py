"""The server keeps the K/V of documents sent in requests in a bounded cache, never in its RAG
store: a real server is sent more documents than the cache holds."""

from __future__ import annotations

import logging

import pytest
from helpers import QuietLLM
from server_helpers import make_tiny_chat_model_dir, raw_request, running_server

from blendkv.entrypoints.openai.api_server import ServeConfig, create_app
from blendkv.store.kv_store import KVStore
from blendkv.store.layered import LayeredKVStore

pytestmark = pytest.mark.timeout(300)

ENGINE = dict(dtype="float32", block_size=4, max_model_len=512)
BOUND = 100_000  # bytes: about three of the documents below (~768 bytes of K/V per token)


def _chat(i: int) -> dict:
    text = f"Report {i}: the warehouse in district {i} holds {i * 13} crates of apples."
    return {
        "messages": [{"role": "user", "content": "How many crates?"}],
        "documents": [{"text": text}],
        "max_tokens": 2,
        "temperature": 0,
    }


def test_request_documents_stay_in_a_bounded_cache(tmp_path, caplog):
    model_dir = make_tiny_chat_model_dir(tmp_path / "model")
    store = tmp_path / "store"
    config = ServeConfig(store_dir=str(store), request_cache_bytes=BOUND)
    app = create_app(lambda: QuietLLM(str(model_dir), **ENGINE), config)
    caplog.set_level(logging.WARNING, logger="blendkv.entrypoints.openai.api_server")
    with running_server(app) as url:
        assert f"store {store} is not calibrated" in caplog.text  # the new store has no curve
        manager = app.state.blendkv.served.rag.manager
        assert isinstance(manager.store, LayeredKVStore)
        cache, rag_store = manager.store.cache, manager.document_store
        rag_chunks = len(rag_store)
        peak, written = 0, 0
        for i in range(10):  # more documents than fit
            status, _, body = raw_request(url, "POST", "/v1/chat/completions", _chat(i))
            assert status == 200, body
            manager.flush()
            stats = cache.stats()
            assert stats.bytes <= BOUND
            peak = max(peak, stats.bytes)
            written = stats.entries + stats.evictions
        assert written == 10 and cache.stats().evictions >= 6  # most were evicted, none kept
        assert peak > BOUND // 2
        assert len(rag_store) == rag_chunks  # nothing went into the RAG store
    with KVStore(store, readonly=True) as s:
        assert len(s) == rag_chunks
