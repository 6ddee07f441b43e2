"""LangChain: a blendkv retriever feeding blendkv generation *as documents* (so they blend).

    pip install langchain-core
    .venv/bin/python examples/langchain_chain.py

Do not join the retrieved documents into one string (the usual ``format_docs`` step): that
throws away the chunk boundaries, and with them the stored K/V.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import RunnablePassthrough

from blendkv import SamplingParams
from blendkv.integrations.langchain import BlendKVGenerator, BlendKVRetriever
from blendkv.rag import RAGPipeline

DOCS = Path(__file__).resolve().parents[1] / "blendkv" / "rag" / "demo_docs"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, RAGPipeline(f"{tmp}/store") as rag:
        rag.ingest([DOCS])
        retriever = BlendKVRetriever(pipeline=rag, k=3)
        generate = BlendKVGenerator(rag, SamplingParams(max_tokens=48, temperature=0.0))
        chain = {"question": RunnablePassthrough(), "documents": retriever} | generate

        message = chain.invoke("Which planet is the largest in the Solar System?")
        print(message.content)
        stats = message.response_metadata["blend_stats"]
        print(
            f"{stats['chunks_hit']}/{stats['num_chunks']} chunks reused, "
            f"TTFT {message.response_metadata['ttft_s'] * 1000:.0f} ms"
        )

        # Plain text out, for chains that expect a string:
        print((chain | StrOutputParser()).invoke("Who created Python?"))


if __name__ == "__main__":
    main()
