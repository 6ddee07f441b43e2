"""LangChain's ``.batch``/``.abatch`` run the chain from several threads at once, and
``.astream`` from an event loop's executor: the issue's chain over one RAGPipeline gives each
question the answer a single ``.invoke`` gives (tiny random Llama, float32, greedy)."""

from __future__ import annotations

import asyncio

import pytest
from helpers import QuietLLM

pytest.importorskip("langchain_core")

from langchain_core.runnables import RunnablePassthrough  # noqa: E402

from blendkv import SamplingParams  # noqa: E402
from blendkv.integrations.langchain import BlendKVGenerator, BlendKVRetriever  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
DOCS = [
    "Octopuses have three hearts and blue blood; two hearts pump blood to the gills.",
    "The Eiffel Tower was finished in 1889 and is made of wrought iron.",
    "Honeybees tell each other where flowers are with a waggle dance.",
    "Jupiter is the largest planet in the Solar System, a gas giant.",
]
QUESTIONS = [
    "How many hearts does an octopus have?",
    "When was the Eiffel Tower finished?",
    "How do bees find flowers?",
    "Which planet is the largest?",
]


@pytest.fixture(scope="module")
def chain(tiny_llama_dir, tmp_path_factory):
    from blendkv.rag import RAGPipeline

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    rag = RAGPipeline(tmp_path_factory.mktemp("lc-batch") / "store", llm=llm, chunk_tokens=16)
    rag.ingest(DOCS, progress=False)
    retriever = BlendKVRetriever(pipeline=rag, k=2)
    yield {"question": RunnablePassthrough(), "documents": retriever} | BlendKVGenerator(
        rag, GREEDY
    )
    rag.close()
    llm.close()


def test_batch_of_four_equals_four_single_calls(chain):
    single = [chain.invoke(q).content for q in QUESTIONS]
    batched = chain.batch(QUESTIONS, config={"max_concurrency": 4})
    assert [m.content for m in batched] == single
    assert all(m.response_metadata["blend_stats"]["num_chunks"] == 2 for m in batched)


def test_abatch_and_astream(chain):
    single = [chain.invoke(q).content for q in QUESTIONS]

    async def run():
        batched = await chain.abatch(QUESTIONS)

        async def streamed(q):
            return "".join([m.content async for m in chain.astream(q)])

        return [m.content for m in batched], await asyncio.gather(*map(streamed, QUESTIONS))

    batched, streamed = asyncio.run(run())
    assert batched == single
    assert streamed == single
