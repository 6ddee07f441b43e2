"""The LangChain retriever passes langchain-tests' standard suite; the generator blends."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402
from langchain_tests.integration_tests import RetrieversIntegrationTests  # noqa: E402

from blendkv import SamplingParams  # noqa: E402
from blendkv.integrations.langchain import BlendKVGenerator, BlendKVRetriever  # noqa: E402

pytestmark = pytest.mark.slow


# The suite's async test carries no marker (it assumes asyncio_mode=auto); the class mark runs
# it under pytest-asyncio without changing the project-wide pytest mode.
@pytest.mark.asyncio
class TestBlendKVRetrieverStandard(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _use_shared_pipeline(self, rag):
        self._rag = rag

    @property
    def retriever_constructor(self) -> type[BlendKVRetriever]:
        return BlendKVRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"pipeline": self._rag}

    @property
    def retriever_query_example(self) -> str:
        return "Which planet is the largest in the Solar System?"


def test_documents_carry_chunk_metadata(rag):
    docs = BlendKVRetriever(pipeline=rag, k=2).invoke("Who created Python?")
    assert len(docs) == 2
    for d in docs:
        assert {"chunk_id", "doc_id", "score", "kv_cached"} <= set(d.metadata)
        assert d.metadata["kv_cached"] is True
        assert rag.store.kv.meta_for_id(d.metadata["chunk_id"]).text == d.page_content
    assert "Guido van Rossum" in docs[0].page_content
    assert docs[0].metadata["source"].endswith("python_language.md")  # LangChain's key


def test_retriever_filter_keeps_to_one_source(rag):
    """The question's best chunks are in python_language.md; filtered to solar_system.md,
    every document comes from there, as many as asked for."""
    [solar] = [e["source"] for e in rag.documents().values() if e["source"].endswith("system.md")]
    retriever = BlendKVRetriever(pipeline=rag, k=3, filter={"source": solar})
    docs = retriever.invoke("Who created Python?")
    assert len(docs) == 3 and {d.metadata["source"] for d in docs} == {solar}
    plain = BlendKVRetriever(pipeline=rag, k=2)
    assert plain.invoke("Who created Python?")[0].metadata["source"] != solar
    docs = plain.invoke("Who created Python?", filter={"source": solar})  # per call
    assert len(docs) == 2 and {d.metadata["source"] for d in docs} == {solar}


def test_chain_hands_documents_to_blending(rag):
    retriever = BlendKVRetriever(pipeline=rag, k=2)
    generator = BlendKVGenerator(rag, SamplingParams(max_tokens=4, temperature=0.0))
    chain = {"question": RunnablePassthrough(), "documents": retriever} | generator
    message = chain.invoke("Which planet is the largest in the Solar System?")
    stats = message.response_metadata["blend_stats"]
    assert stats["num_chunks"] == stats["chunks_hit"] == 2  # one chunk per document
    assert stats["chunks_missed"] == 0 and stats["tokens_reused"] > 0
    assert message.response_metadata["ttft_s"] > 0


def test_generator_accepts_foreign_documents(rag):
    generator = BlendKVGenerator(rag, SamplingParams(max_tokens=2, temperature=0.0))
    [stored] = BlendKVRetriever(pipeline=rag, k=1).invoke("honeybee queen eggs")
    foreign = Document(page_content="Drones are male honeybees; they do not sting.")
    message = generator.invoke({"question": "Do drones sting?", "documents": [stored, foreign]})
    stats = message.response_metadata["blend_stats"]
    assert stats["num_chunks"] == 2 and stats["chunks_hit"] >= 1


def test_generator_puts_documents_in_the_pipelines_chunk_order(rag):
    """The chain answers as ``rag.query`` does: the same chunks, in the same prompt order."""
    question = "Which planet is the largest in the Solar System?"
    params = SamplingParams(max_tokens=6, temperature=0.0)
    docs = BlendKVRetriever(pipeline=rag, k=3).invoke(question)  # best first
    for order in ("relevance_last", "relevance_first"):
        generator = BlendKVGenerator(rag, params, chunk_order=order)
        message = generator.invoke({"question": question, "documents": docs})
        assert message.content == rag.query(question, 3, params, chunk_order=order).answer
