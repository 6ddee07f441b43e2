"""The server with the embedded SmolLM2-135M-Instruct (a real chat template): chat, chat with
``documents`` (stored chunk K/V reused on the second request), ``rag`` over ``--store``, each
equal to the same request run in-process with ``LLM``."""

from __future__ import annotations

import openai
import pytest
from helpers import QuietLLM
from server_helpers import running_server

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.entrypoints.openai.api_server import ServeConfig, create_app
from blendkv.rag import RAGPipeline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Prefix caching off: a repeated document is served from the chunk store, not the prefix cache.
ENGINE = dict(dtype="float32", enable_prefix_caching=False, num_kv_blocks=256)
SYSTEM = "You answer in one short sentence."
DOCS = [
    {
        "title": "Honeybees",
        "text": "Worker bees tell each other where flowers are with a "
        "waggle dance. The angle of the dance points to the flowers.",
    },
    {"text": "Jupiter is the largest planet in the Solar System. It is a gas giant."},
]
STORE_DOC = (
    "The Python programming language was created by Guido van Rossum. It was first released "
    "in 1991.\n\nPython emphasises readability and uses indentation to delimit blocks."
)
BRIDGE_DOC = "The Copper Bridge over the Slate River opened to trains in 1903."


@pytest.fixture(scope="module")
def in_process():
    llm = QuietLLM(**ENGINE)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    store = tmp_path_factory.mktemp("serve-store") / "store"
    llm = QuietLLM(**ENGINE)
    bridges = store.parent / "bridges.md"
    bridges.write_text(BRIDGE_DOC)
    with RAGPipeline(store, llm=llm, chunk_tokens=24) as rag:  # what `blendkv ingest` does
        rag.ingest([STORE_DOC], metadata={"topic": "python"}, progress=False)
        rag.ingest([bridges], metadata={"topic": "bridges"}, progress=False)
    app = create_app(llm, ServeConfig(store_dir=str(store)))  # the server closes the LLM
    with running_server(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def model(client) -> str:
    return client.models.list().data[0].id


def test_chat_matches_in_process(client, in_process):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What colour is the sky?"},
    ]
    resp = client.chat.completions.create(
        model=model(client), messages=messages, max_tokens=24, temperature=0
    )
    ref = in_process.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0]
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_with_documents_reuses_chunks_and_matches_in_process(client, in_process):
    query = "How do bees tell each other where flowers are?"
    kw = dict(
        model=model(client),
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": query}],
        max_tokens=24,
        temperature=0,
        extra_body={"documents": DOCS, "blend": {"recompute_ratio": 0.15}},
    )
    first = client.chat.completions.create(**kw)
    assert first.blendkv["num_chunks"] == 2
    raw = client.chat.completions.with_raw_response.create(**kw)
    second = raw.parse()
    stats = second.blendkv
    assert stats["chunks_hit"] == 2 and stats["chunks_missed"] == 0  # stored by the first
    assert stats["tokens_reused"] > 0 and stats["kv_bytes_loaded"] > 0
    assert raw.headers["x-blendkv-chunks-hit"] == "2"
    assert int(raw.headers["x-blendkv-tokens-reused"]) == stats["tokens_reused"]

    texts = [f"{d['title']}\n{d['text']}" if "title" in d else d["text"] for d in DOCS]
    prompt = {"documents": texts, "query": query, "system": SYSTEM}
    [ref] = in_process.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24), blend=BlendConfig(0.15)
    )
    assert ref.text.strip()
    assert first.choices[0].message.content == second.choices[0].message.content == ref.text

    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices[0].finish_reason == second.choices[0].finish_reason
    assert chunks[-1].blendkv["chunks_hit"] == 2  # stats ride on the final chunk


def test_rag_retrieves_from_the_store(client):
    resp = client.chat.completions.create(
        model=model(client),
        messages=[{"role": "user", "content": "Who created the Python programming language?"}],
        max_tokens=16,
        temperature=0,
        extra_body={"rag": {"top_k": 2}},
    )
    info = resp.blendkv
    assert len(info["sources"]) == 2
    assert any("Guido van Rossum" in s["text"] for s in info["sources"])
    assert info["num_chunks"] == 2 and info["chunks_hit"] == 2  # ingested K/V, reused
    assert resp.choices[0].message.content


def test_rag_sources_name_their_document_and_a_filter_keeps_to_it(client):
    kw = dict(
        model=model(client),
        messages=[{"role": "user", "content": "Who created the Python programming language?"}],
        max_tokens=4,
        temperature=0,
    )
    resp = client.chat.completions.create(**kw, extra_body={"rag": {"top_k": 1}})
    [best] = resp.blendkv["sources"]
    assert best["metadata"] == {"topic": "python"} and best["source"] is None  # a bare text
    resp = client.chat.completions.create(
        **kw, extra_body={"rag": {"top_k": 2, "filter": {"topic": "bridges"}}}
    )
    [only] = resp.blendkv["sources"]  # the filtered document has one chunk
    assert only["source"].endswith("bridges.md") and only["metadata"] == {"topic": "bridges"}
    assert "Copper Bridge" in only["text"]
    with pytest.raises(openai.BadRequestError, match="no document matches the filter"):
        client.chat.completions.create(
            **kw, extra_body={"rag": {"top_k": 2, "filter": {"topic": "none"}}}
        )


def test_rag_chunk_order(client):
    kw = dict(
        model=model(client),
        messages=[{"role": "user", "content": "Who created the Python programming language?"}],
        max_tokens=1,
        temperature=0,
    )
    ids = {}
    for order in ("relevance_first", "relevance_last", None):
        rag = {"top_k": 3} if order is None else {"top_k": 3, "chunk_order": order}
        resp = client.chat.completions.create(**kw, extra_body={"rag": rag})
        ids[order] = [s["chunk_id"] for s in resp.blendkv["sources"]]  # in prompt order
    assert len(ids["relevance_first"]) == 3
    assert ids["relevance_last"] == ids["relevance_first"][::-1] == ids[None]  # the default
    with pytest.raises(openai.BadRequestError, match="unknown chunk order 'best'"):
        client.chat.completions.create(**kw, extra_body={"rag": {"chunk_order": "best"}})
