"""The LlamaIndex retriever returns NodeWithScore carrying blendkv chunk metadata."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core", reason="llama-index-core is not installed")

from llama_index.core.schema import NodeWithScore  # noqa: E402

from blendkv.integrations.llamaindex import BlendKVLlamaIndexRetriever  # noqa: E402

pytestmark = pytest.mark.slow


def test_retrieve_nodes(rag):
    retriever = BlendKVLlamaIndexRetriever(rag, similarity_top_k=3)
    nodes = retriever.retrieve("How do worker bees tell each other where flowers are?")
    assert len(nodes) == 3 and all(isinstance(n, NodeWithScore) for n in nodes)
    assert "waggle dance" in nodes[0].node.get_content()
    assert [n.score for n in nodes] == sorted((n.score for n in nodes), reverse=True)
    for n in nodes:
        meta = n.node.metadata
        assert {"chunk_id", "doc_id", "score", "kv_cached"} <= set(meta)
        assert meta["score"] == pytest.approx(n.score)
        assert rag.store.kv.meta_for_id(meta["chunk_id"]).text == n.node.get_content()
