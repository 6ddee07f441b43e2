"""One RAG pipeline (embedded model, float32) over the demo documents, shared by the RAG and
integration tests so the model loads and the corpus is ingested once per test session."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from helpers import QuietLLM

import blendkv.rag

DEMO_DOCS = Path(blendkv.rag.__file__).parent / "demo_docs"
CHUNK_TOKENS = 64
# question -> (demo file, a phrase the best chunk must contain)
KNOWN = {
    "Who created the Python programming language?": ("python_language.md", "Guido van Rossum"),
    "Which planet is the largest in the Solar System?": (
        "solar_system.md",
        "Jupiter is the largest",
    ),
    "How do worker bees tell each other where flowers are?": ("honeybees.txt", "waggle dance"),
}

_shared: dict = {}


def shared_pipeline():
    """(pipeline, IngestReport of the demo docs); created on first call, closed at exit."""
    if not _shared:
        from blendkv.rag import RAGPipeline

        tmp = tempfile.mkdtemp(prefix="blendkv-rag-tests-")
        # A quarter of the default pool (5,800 tokens): it lives for the whole session.
        llm = QuietLLM(
            dtype="float32", enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20
        )
        rag = RAGPipeline(Path(tmp) / "store", llm=llm, chunk_tokens=CHUNK_TOKENS)
        report = rag.ingest([DEMO_DOCS], progress=False)

        def cleanup() -> None:
            rag.close()
            llm.close()
            shutil.rmtree(tmp, ignore_errors=True)

        atexit.register(cleanup)
        _shared.update(rag=rag, report=report)
    return _shared["rag"], _shared["report"]
