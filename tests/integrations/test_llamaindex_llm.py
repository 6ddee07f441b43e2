"""``BlendKVLLM``: LlamaIndex's complete/chat (plain, streamed, async) equal the blendkv ``LLM``'s
greedy output, concurrent calls each get their own answer, and LlamaIndex's own
``RetrieverQueryEngine`` runs on it over the blendkv retriever (tiny random Llama, float32)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import QuietLLM

pytest.importorskip("llama_index.core", reason="llama-index-core is not installed")

from llama_index.core.base.llms.generic_utils import messages_to_prompt  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402

from blendkv import SamplingParams  # noqa: E402
from blendkv.integrations.llamaindex_llm import BlendKVLLM  # noqa: E402

PROMPTS = ["The quick brown fox", "Paged attention stores", "Paris is the capital of", "One two"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def expected(llm) -> list[str]:
    return [out.text for out in llm.generate(PROMPTS, GREEDY)]


def test_complete_and_stream_complete(llm, expected):
    li = BlendKVLLM(llm, sampling_params=GREEDY)
    assert li.complete(PROMPTS[0]).text == expected[0]
    chunks = list(li.stream_complete(PROMPTS[0]))
    assert len(chunks) == GREEDY.max_tokens
    assert "".join(c.delta for c in chunks) == chunks[-1].text == expected[0]


def test_defaults_are_greedy_and_per_call_overrides(llm):
    li = BlendKVLLM(llm, max_tokens=12)
    [want] = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=12))
    assert li.complete(PROMPTS[2]).text == want.text
    short = li.complete(PROMPTS[2], max_tokens=2, ignore_eos=True, not_a_param=1)
    assert len(short.raw.outputs[0].token_ids) == 2
    assert li.metadata.num_output == 12
    assert li.metadata.context_window == llm.engine.info.max_model_len


def test_chat_without_a_template_uses_the_generic_rendering(llm):
    li = BlendKVLLM(llm, sampling_params=GREEDY)
    assert not li.metadata.is_chat_model  # the tiny tokenizer has no chat template
    messages = [ChatMessage(role="user", content="Paris is the capital of")]
    [want] = llm.generate([messages_to_prompt(messages)], GREEDY)
    reply = li.chat(messages)
    assert reply.message.role == "assistant" and reply.message.content == want.text
    streamed = list(li.stream_chat(messages))
    assert streamed[-1].message.content == want.text


def test_threads_and_gather_get_their_own_answers(llm, expected):
    li = BlendKVLLM(llm, sampling_params=GREEDY)
    with ThreadPoolExecutor(4) as pool:
        assert [r.text for r in pool.map(li.complete, PROMPTS)] == expected

    async def run():
        plain = await asyncio.gather(*(li.acomplete(p) for p in PROMPTS))

        async def streamed(p: str) -> str:
            return "".join([c.delta async for c in await li.astream_complete(p)])

        return [r.text for r in plain], await asyncio.gather(*map(streamed, PROMPTS))

    plain, streams = asyncio.run(run())
    assert plain == expected and streams == expected


def test_llamaindex_retriever_query_engine_runs_on_it(llm, tmp_path):
    from llama_index.core.query_engine import RetrieverQueryEngine

    from blendkv.integrations.llamaindex import BlendKVLlamaIndexRetriever
    from blendkv.rag import RAGPipeline

    with RAGPipeline(tmp_path / "store", llm=llm, chunk_tokens=64) as rag:
        rag.ingest(
            ["Honeybees tell each other where flowers are with a waggle dance."], progress=False
        )
        engine = RetrieverQueryEngine.from_args(
            BlendKVLlamaIndexRetriever(rag, similarity_top_k=1),
            llm=BlendKVLLM(llm, sampling_params=GREEDY),
        )
        response = engine.query("How do bees find flowers?")
    assert len(response.source_nodes) == 1 and "waggle" in response.source_nodes[0].text
    assert isinstance(response.response, str) and response.response
