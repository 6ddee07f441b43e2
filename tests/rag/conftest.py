from __future__ import annotations

import pytest
from helpers import QuietLLM


@pytest.fixture(scope="module")
def tiny_rag(tiny_llama_dir, tmp_path_factory):
    """A RAG pipeline over the tiny random Llama (float32) and the real MiniLM embedder, with
    its own store; nothing ingested yet."""
    from blendkv.rag import RAGPipeline

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    store = tmp_path_factory.mktemp("tiny-rag") / "store"
    rag = RAGPipeline(store, llm=llm, chunk_tokens=32)
    yield rag
    rag.close()
    llm.close()
