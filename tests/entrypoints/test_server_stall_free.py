"""The server under one heavy request, driven by the official ``openai`` client:
while a chat request with hundreds of new documents is precomputed, a running stream gets a
token every engine step and a new short request is answered before the documents are done;
closing the big request's stream aborts it (no blocks left, no more precompute). Size limits
refuse a 10 MB prompt and too many documents with a 400 that names the limit, before any
tokenising. Steps are counted by a step listener on the engine thread, never timed."""

from __future__ import annotations

import openai
import pytest
from helpers import QuietLLM
from server_helpers import TINY_CHAT_TEMPLATE, running_server, wait_for

from blendkv.entrypoints.openai.api_server import ServeConfig, create_app

pytestmark = pytest.mark.timeout(600)

N_DOCS = 400
MAX_DOCS = 500
MAX_DOC_TOKENS = 9000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, the app's server state, per-step records from the engine thread)."""
    import json

    from helpers import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path_factory.mktemp("chat"), max_position_embeddings=16384)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TINY_CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    llm = QuietLLM(str(path), dtype="float32", block_size=16, max_num_batched_tokens=64)
    app = create_app(
        llm, ServeConfig(max_request_documents=MAX_DOCS, max_document_tokens=MAX_DOC_TOKENS)
    )
    with running_server(app) as url:
        state = app.state.blendkv
        engine = state.served.engine
        steps: list[tuple[set[str], int]] = []  # (ids with an output, precomputing) per step

        def record(outputs) -> None:  # on the engine thread
            precomputing = len(engine.llm.engine.scheduler.precomputing)
            steps.append(({o.request_id for o in outputs}, precomputing))

        engine.add_step_listener(record)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        yield client, state, steps


def chat(client, text: str, max_tokens: int, stream: bool, documents=None):
    extra = {"ignore_eos": True}
    if documents is not None:
        extra["documents"] = documents
    return client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
        extra_body=extra,
    )


def test_a_stream_and_a_short_request_are_served_while_documents_precompute(served):
    client, state, steps = served
    engine = state.served.engine
    stream = chat(client, "Count to a thousand:", 2000, stream=True)
    first = next(iter(stream))
    stream_id = first.id
    docs = [{"text": f"fact {i}: box {i} is blue."} for i in range(N_DOCS)]
    # Returns once the request is queued (the response headers came).
    big = chat(client, "Which box is blue?", 4, stream=True, documents=docs)
    assert wait_for(lambda: any(p for _, p in steps), 120)
    short = chat(client, "Paris is", 3, stream=False)
    short_steps = [i for i, (ids, _) in enumerate(steps) if short.id in ids]
    # The short request was answered while the documents were still being precomputed.
    assert len(short_steps) == 3 and steps[short_steps[-1]][1] == 1
    # Every step with the big request precomputing gave the stream a token.
    precomputing = [ids for ids, p in steps if p]
    assert len(precomputing) >= 3
    assert all(stream_id in ids for ids in precomputing)
    # Closing the stream of the big request (a client gone) aborts it mid-precompute.
    assert steps[-1][1] == 1
    big.close()
    stream.close()
    assert wait_for(lambda: engine.stats.num_kv_blocks_used == 0 and not engine.stats.num_waiting)
    assert engine.stats.num_precomputing == 0 and engine.stats.num_aborted >= 2


def test_size_limits_are_checked_before_tokenising(served):
    client, state, _ = served
    limit = state.limits.max_prompt_bytes
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=None, prompt="a" * (10 << 20), max_tokens=1)
    assert err.value.status_code == 400
    assert str(limit) in err.value.message and err.value.code == "prompt_too_large"
    docs = [{"text": "x"}] * (MAX_DOCS + 1)
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "Which?", 1, stream=False, documents=docs)
    assert err.value.code == "too_many_documents" and "--max-request-documents" in str(err.value)
    assert str(MAX_DOCS) in err.value.message
    # Under the byte bound (16 per token), over the token limit: refused once tokenised.
    text = " ".join("abcdefghij"[i % 10] for i in range(7_000))
    assert len(text.encode()) < 16 * MAX_DOC_TOKENS
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "Which?", 1, stream=False, documents=[{"text": text}])
    assert err.value.code == "documents_too_long" and "--max-document-tokens" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:  # over the bytes: before tokenising
        chat(client, "Which?", 1, stream=False, documents=[{"text": "ab" * 16 * MAX_DOC_TOKENS}])
    assert err.value.code == "documents_too_long" and "bytes" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "x" * (limit + 1), 1, stream=False)
    assert err.value.code == "prompt_too_large" and err.value.param == "messages"
