"""LlamaIndex: blendkv's store as a retriever; answer from the nodes' stored chunk K/V.

pip install llama-index-core
.venv/bin/python examples/llamaindex_retriever.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.integrations.llamaindex import BlendKVLlamaIndexRetriever
from blendkv.rag import RAGPipeline

DOCS = Path(__file__).resolve().parents[1] / "blendkv" / "rag" / "demo_docs"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, RAGPipeline(f"{tmp}/store", dtype="float32") as rag:
        rag.ingest([DOCS])
        retriever = BlendKVLlamaIndexRetriever(rag, similarity_top_k=3)
        question = "How do worker bees tell each other where flowers are?"
        nodes = retriever.retrieve(question)
        for n in nodes:
            print(
                f"{n.score:.2f}  chunk {n.node.metadata['chunk_id']}: {n.node.get_content()[:60]}"
            )

        # Hand the nodes back to blendkv by chunk id: their stored K/V is blended, not re-read.
        prompt = {
            "chunk_ids": [n.node.metadata["chunk_id"] for n in nodes],
            "query": f"\n\nQuestion: {question}\nAnswer:",
        }
        [out] = rag.llm.generate(
            [prompt], SamplingParams(max_tokens=48), blend=BlendConfig(recompute_ratio=0.15)
        )
        print(out.text.strip())
        print(out.blend_stats.to_dict())


if __name__ == "__main__":
    main()
