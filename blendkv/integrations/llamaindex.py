"""LlamaIndex adapter: a retriever over a :class:`~blendkv.rag.RAGPipeline`.

    retriever = BlendKVLlamaIndexRetriever(rag, similarity_top_k=4)
    nodes = retriever.retrieve("Who created Python?")   # NodeWithScore, best first

Node metadata carries ``chunk_id``, ``doc_id``, ``score`` and ``kv_cached``, so a caller can
pass ``[n.node.metadata["chunk_id"] for n in nodes]`` back to blendkv generation as
``chunk_ids`` and keep the stored K/V. Needs ``pip install llama-index-core``. Thread-safe,
as the pipeline's ``retrieve`` is.
"""

from __future__ import annotations

from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode


class BlendKVLlamaIndexRetriever(BaseRetriever):
    def __init__(self, pipeline, similarity_top_k: int = 6, **kwargs) -> None:
        self._pipeline = pipeline
        self._similarity_top_k = similarity_top_k
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        chunks = self._pipeline.retrieve(query_bundle.query_str, self._similarity_top_k)
        nodes = []
        for c in chunks:
            node = TextNode(
                id_=f"blendkv-chunk-{c.chunk_id}", text=c.text, metadata=c.retriever_metadata()
            )
            nodes.append(NodeWithScore(node=node, score=c.score))
        return nodes
