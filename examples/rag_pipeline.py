"""RAG pipeline quickstart: ingest documents once, then answer from their stored K/V.

    .venv/bin/python examples/rag_pipeline.py [STORE_DIR]

The store persists: run it twice and the second run skips ingestion (documents are keyed by a
hash of their content) and answers straight from the stored chunk K/V.
"""

from __future__ import annotations

import sys
from pathlib import Path

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.rag import RAGAnswer, RAGPipeline

DOCS = Path(__file__).resolve().parents[1] / "blendkv" / "rag" / "demo_docs"


def main() -> None:
    store_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp/blendkv-example-store"
    # dtype "auto" (the default) follows an existing store's dtype (a store serves only the
    # dtype it was built in); a new store gets bfloat16 on CPUs with native bfloat16 (AMX,
    # AVX512-BF16), float32 on others, where bfloat16 runs several times slower.
    with RAGPipeline(store_dir, chunk_tokens=128) as rag:
        print(rag.ingest([DOCS]).summary())  # Path = a file or a folder of .txt/.md
        rag.add_documents(
            ["Blendkv stores each chunk's K/V once and blends it at query time."],
            metadata={"source": "inline"},
        )

        question = "Who created the Python programming language?"
        answer = rag.query(
            question,
            k=3,
            sampling_params=SamplingParams(max_tokens=48, temperature=0.0),
            blend=BlendConfig(recompute_ratio=0.15),
        )
        print(f"\nQ: {question}\nA: {answer.answer}")
        for s in answer.sources:  # the file a chunk came from; a text's source or doc id
            name = Path(s.source).name if s.source else s.doc_id
            print(f"   chunk {s.chunk_id} ({name}, score {s.score:.2f}, kv_cached={s.kv_cached})")
        st = answer.blend_stats
        print(
            f"   {st.chunks_hit}/{st.num_chunks} chunks reused, {st.tokens_recomputed} tokens "
            f"recomputed, TTFT {answer.ttft * 1000:.0f} ms"
        )

        print("\nStreaming:")
        for piece in rag.stream_query("What is the tallest mountain in the Solar System?", k=2):
            if isinstance(piece, RAGAnswer):
                print(f"\n   (TTFT {piece.ttft * 1000:.0f} ms)")
            else:
                print(piece, end="", flush=True)


if __name__ == "__main__":
    main()
