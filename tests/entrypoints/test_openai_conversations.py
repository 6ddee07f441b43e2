"""Conversations with documents: the documents attach to the conversation (inside its first user
turn), earlier turns are ordinary computed text, and a follow-up turn reuses the documents' K/V
and the prompt blocks it shares with the turn before. Driven by the ``openai`` client and by
LangChain's ``ChatOpenAI`` over several turns."""

from __future__ import annotations

import openai
import pytest
from helpers import QuietLLM
from server_helpers import make_tiny_chat_model_dir, raw_request, running_server

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.entrypoints.openai.api_server import ServeConfig, create_app

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
ENGINE = dict(
    dtype="float32", block_size=4, max_model_len=512, max_num_seqs=8, attention_backend="torch"
)
DOCS = [
    "Paris is the capital of France. The Seine flows through Paris.",
    "Berlin is the capital of Germany. It has many museums and parks.",
]
EXTRA = {"documents": [{"text": d} for d in DOCS], "blend": {"recompute_ratio": 0.3}}
SYSTEM = "Answer from the documents."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model_dir(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = QuietLLM(str(model_dir), **ENGINE)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(model_dir):
    app = create_app(
        lambda: QuietLLM(str(model_dir), **ENGINE), ServeConfig(served_model_name=MODEL)
    )
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)


def ask(client, messages, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=EXTRA, **kw
    )


def test_follow_up_turns_blend_the_same_documents(client, offline):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which city is the capital of France?"},
    ]
    first = ask(client, messages)
    answer = first.choices[0].message.content
    assert first.blendkv["num_chunks"] == 2
    # The same two turns in process, in the same order (the second reuses blocks of the first,
    # as in the server: the blend's prefix-cache salt names the chunks, not the query).
    greedy, blend = SamplingParams(temperature=0, max_tokens=8), BlendConfig(recompute_ratio=0.3)
    one = {"documents": DOCS, "query": messages[1]["content"], "system": SYSTEM}
    [ref_first] = offline.generate(one, greedy, blend=blend)
    assert ref_first.text == answer
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Germany?"},
    ]
    second = ask(client, messages)
    # The turns after the documents, as the tiny model's template renders them (its one-turn
    # suffix "\n<s>assistant:" is the blended prompt's own).
    turns = (
        f"Which city is the capital of France?\n<s>assistant: {answer}\n<s>user: And of Germany?"
    )
    prompt = {"documents": DOCS, "query": turns, "system": SYSTEM}
    [ref] = offline.generate(prompt, greedy, blend=blend)
    assert second.choices[0].message.content == ref.text
    assert second.usage.prompt_tokens == len(ref.prompt_token_ids)
    stats = second.blendkv
    # The documents' K/V is reused: the follow-up's prompt starts like the first turn's, so
    # the blended blocks of the first turn (documents included) come from the prefix cache
    # and no document is computed again.
    assert stats["num_chunks"] == 2 and stats["chunks_missed"] == 0
    assert stats["prefix_cached_tokens"] >= first.blendkv["tokens_reused"] > 0
    assert second.usage.prompt_tokens_details.cached_tokens == stats["prefix_cached_tokens"]
    messages += [
        {"role": "assistant", "content": second.choices[0].message.content},
        {"role": "user", "content": "Thanks."},
    ]
    third = ask(client, messages)
    assert third.blendkv["chunks_missed"] == 0
    cached = third.usage.prompt_tokens_details.cached_tokens
    assert cached > second.usage.prompt_tokens_details.cached_tokens


def test_langchain_multi_turn_with_documents(server, client):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=f"{server}/v1",
        api_key="none",
        model=MODEL,
        temperature=0,
        max_tokens=8,
        max_retries=0,
        timeout=60,
        extra_body=EXTRA,
    )
    history = [SystemMessage(SYSTEM), HumanMessage("Which city is the capital of France?")]
    raw = []
    for follow_up in ("And of Germany?", "Thanks."):
        reply = chat.invoke(history)
        history += [AIMessage(reply.content), HumanMessage(follow_up)]
        raw.append(reply.content)
    final = chat.invoke(history)
    messages = [{"role": "system", "content": SYSTEM}]
    for m in history[1:]:
        messages.append(
            {"role": "user" if isinstance(m, HumanMessage) else "assistant", "content": m.content}
        )
    ref = ask(client, messages)
    assert final.content == ref.choices[0].message.content
    assert ref.blendkv["num_chunks"] == 2 and ref.blendkv["chunks_missed"] == 0
    assert [m.content for m in history if isinstance(m, AIMessage)] == raw


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Paris?"}],
        [{"role": "user", "content": "Paris?"}, {"role": "assistant", "content": "Yes"}],
        [{"role": "system", "content": "Be brief."}],
    ],
)
def test_conversations_that_cannot_hold_documents_are_refused(server, messages):
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, **EXTRA}
    status, _, err = raw_request(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and err["error"]["param"] == "messages", err


NO_SYSTEM_ROLE = (  # a template that refuses a system role, as Gemma 2's does
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
    "{% endif %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def test_turns_split_also_where_the_template_has_no_system_role():
    from helpers import make_tokenizer

    from blendkv.entrypoints.openai.conversation import split_blended_chat
    from blendkv.entrypoints.openai.protocol import ChatMessage

    tok = make_tokenizer(320)
    tok.chat_template = NO_SYSTEM_ROLE
    turns = [("system", "S"), ("user", "u1"), ("assistant", "a1"), ("user", "u2")]
    messages = [ChatMessage(role=r, content=c) for r, c in turns]
    assert split_blended_chat(messages, tok) == ("S", "u2", "u1\n<s>assistant: a1\n<s>user: u2")
    assert split_blended_chat(messages[:2], tok) == ("S", "u1", "u1")  # one turn: the question
