"""A dropped pipeline frees its model at once (no reference cycle waiting for the garbage
collector): test suites and notebooks that drop pipelines without closing them would otherwise
hold one KV pool per pipeline until a full collection."""

from __future__ import annotations

import gc
import weakref

from helpers import QuietLLM

from blendkv.rag import RAGPipeline


def test_dropped_pipeline_and_model_are_freed_without_gc(tiny_llama_dir, tmp_path):
    gc.collect()
    gc.disable()
    try:
        llm = QuietLLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
        rag = RAGPipeline(tmp_path / "store", llm=llm, chunk_tokens=16)
        rag.ingest(["Bees make honey from the nectar of flowers."], progress=False)
        rag.query("What do bees make?", k=1)
        model, pipeline = weakref.ref(llm), weakref.ref(rag)
        del llm, rag
        assert pipeline() is None and model() is None
    finally:
        gc.enable()
