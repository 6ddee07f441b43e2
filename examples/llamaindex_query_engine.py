"""LlamaIndex: a query engine that answers from blendkv's stored chunk K/V, plain and streamed.

    pip install llama-index-core
    .venv/bin/python examples/llamaindex_query_engine.py [--model HF_DIR_OR_GGUF]

The engine retrieves the chunks and blends their stored K/V behind the pipeline's instruction
(the one the K/V was precomputed behind), greedy; ``response.source_nodes`` are the chunks.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from blendkv.integrations.llamaindex import BlendKVQueryEngine
from blendkv.rag import RAGPipeline

DOCS = Path(__file__).resolve().parents[1] / "blendkv" / "rag" / "demo_docs"


def print_sources(source_nodes) -> None:
    for n in source_nodes:
        meta = n.node.metadata
        where = Path(meta.get("source") or meta["doc_id"]).name
        text = " ".join(n.node.get_content().split())[:60]
        print(f"  {n.score:.2f}  {where} (chunk {meta['chunk_id']}): {text}...")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a HF folder or .gguf file (default: embedded SmolLM2)")
    args = parser.parse_args(argv)
    model = {"model": args.model} if args.model else {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        RAGPipeline(f"{tmp}/store", chunk_tokens=128, **model) as rag,
    ):
        print(rag.ingest([DOCS], progress=False).summary())
        engine = BlendKVQueryEngine(rag, similarity_top_k=3)

        question = "Who created the Python programming language?"
        response = engine.query(question)
        print(f"\nQ: {question}\nA: {response.response}")
        print_sources(response.source_nodes)
        stats = response.metadata["blend_stats"]
        print(
            f"  {stats['chunks_hit']}/{stats['num_chunks']} chunks from the store, "
            f"TTFT {response.metadata['ttft_s'] * 1000:.0f} ms"
        )

        # Streamed: the text arrives piece by piece; the sources come with the last piece.
        streaming = BlendKVQueryEngine(rag, similarity_top_k=3, streaming=True)
        question = "Which planet is the largest in the Solar System?"
        print(f"\nQ: {question}\nA: ", end="")
        response = streaming.query(question)
        response.print_response_stream()
        print()
        print_sources(response.source_nodes)


if __name__ == "__main__":
    main()
