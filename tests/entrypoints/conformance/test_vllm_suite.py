"""vLLM's OpenAI-server tests (``tests/entrypoints/openai/``: completion, chat, prompt
validation), adapted to blendkv's tiny model: the behaviour each checks, written here. Tests of
features blendkv does not build are kept as skips naming the reason (the parameter table in
docs/guide/requests.md), or check the clean 400 that replaces the feature."""

from __future__ import annotations

import json
import re

import openai
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"  # conftest.py's server
NO_EOS = {"ignore_eos": True}
SESSION = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is 1+1?"},
]


# ------------------------------------------------------------------------- completions
def test_single_completion(client):
    c = client.completions.create(
        model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0, extra_body=NO_EOS
    )
    assert c.id and len(c.choices) == 1 and c.choices[0].finish_reason == "length"
    u = c.usage
    assert u.completion_tokens == 5 and u.total_tokens == u.prompt_tokens + 5
    assert u.prompt_tokens_details is not None
    by_ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9], max_tokens=5)
    assert by_ids.choices[0].prompt_logprobs is None


def test_no_zero_some_and_too_many_logprobs(client):
    kw = dict(model=MODEL, prompt=[5, 6, 7, 8, 9], max_tokens=5, temperature=0)
    assert client.completions.create(**kw, logprobs=None).choices[0].logprobs is None
    zero = client.completions.create(**kw, logprobs=0).choices[0].logprobs
    assert zero.token_logprobs and len(zero.top_logprobs[0]) == 1
    some = client.completions.create(**kw, logprobs=5).choices[0].logprobs
    assert 5 <= len(some.top_logprobs[0]) <= 6
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**kw, logprobs=21)
    with pytest.raises(openai.BadRequestError):
        list(client.completions.create(**kw, logprobs=30, stream=True))
    assert client.completions.create(**kw).choices[0].finish_reason is not None


def test_completion_streaming(client):
    kw = dict(model=MODEL, prompt="What is an LLM?", max_tokens=5, temperature=0, extra_body=NO_EOS)
    single = client.completions.create(**kw).choices[0].text
    texts, finishes = [], 0
    for chunk in client.completions.create(**kw, stream=True):
        texts.append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == "length" and chunk.choices[0].text
    assert "".join(texts) == single


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_sampling(client, stream):
    kw = dict(model=MODEL, prompt="What is an LLM?", max_tokens=24, n=3, temperature=1.0, seed=42)
    if not stream:
        c = client.completions.create(**kw, logprobs=0)
        assert [ch.index for ch in c.choices] == [0, 1, 2]
        assert all(ch.finish_reason for ch in c.choices)
        assert len({ch.text for ch in c.choices}) == 3
        return
    texts, finishes = ["", "", ""], 0
    for chunk in client.completions.create(**kw, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 3 and len(set(texts)) == 3


def test_completion_stream_options(client):
    kw = dict(model=MODEL, prompt="The capital of France", max_tokens=5, temperature=0)
    kw.update(stream=True, extra_body=NO_EOS)
    for opts in ({"include_usage": False, "continuous_usage_stats": True}, {}):
        assert all(c.usage is None for c in client.completions.create(**kw, stream_options=opts))
    chunks = list(client.completions.create(**kw, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    both = {"include_usage": True, "continuous_usage_stats": True}
    for c in client.completions.create(**kw, stream_options=both):
        assert c.usage.prompt_tokens > 0 and c.usage.completion_tokens > 0
    for opts in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**{**kw, "stream": False}, stream_options=opts)


def test_batch_completions_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model=MODEL, prompt=["Hello", "World"], max_tokens=3)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_prompt_logprobs_completion(client, k):
    ids = [5, 6, 7, 8, 9, 10]
    c = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": k}
    )
    plp = c.choices[0].prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for i, entry in enumerate(plp[1:], start=1):
        assert str(ids[i]) in entry and len(entry) in (max(k, 1), k + 1)
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    chat = client.chat.completions.create(
        model=MODEL, messages=SESSION, max_completion_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    for bad in (-1, 21):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                model=MODEL, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": bad}
            )
        assert err.value.body["param"] == "prompt_logprobs"
    blended = {"prompt_logprobs": 1, "documents": [{"text": "Paris is in France."}]}
    with pytest.raises(openai.BadRequestError) as err:  # reused chunks: no model values
        client.chat.completions.create(
            model=MODEL, messages=SESSION, max_completion_tokens=2, extra_body=blended
        )
    assert err.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as err:  # vLLM streams them; blendkv refuses
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert err.value.body["param"] == "prompt_logprobs"


@pytest.mark.skip(reason="truncate_prompt_tokens is refused (400): prompts are never cut")
def test_completion_truncation():
    pass


def test_out_of_vocab_token_ids(client):
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=MODEL, prompt=[999_999], max_tokens=5)


# ------------------------------------------------------------------------------- chat
def test_single_chat_session(client):
    c = client.chat.completions.create(
        model=MODEL, messages=SESSION, max_completion_tokens=10, logprobs=True, top_logprobs=5
    )
    assert c.id and len(c.choices) == 1
    choice = c.choices[0]
    assert choice.message.role == "assistant" and choice.logprobs.content
    assert len(choice.logprobs.content[0].top_logprobs) == 5
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    follow = [*SESSION, {"role": "assistant", "content": choice.message.content}]
    follow.append({"role": "user", "content": "express your result in json"})
    again = client.chat.completions.create(model=MODEL, messages=follow, max_completion_tokens=10)
    assert again.choices[0].message.content is not None


def test_chat_logprobs_none_zero_and_too_many(client):
    kw = dict(model=MODEL, messages=SESSION, max_completion_tokens=5, temperature=0)
    assert client.chat.completions.create(**kw, logprobs=False).choices[0].logprobs is None
    zero = client.chat.completions.create(**kw, logprobs=True, top_logprobs=0)
    assert (
        zero.choices[0].logprobs.content and zero.choices[0].logprobs.content[0].top_logprobs == []
    )
    some = client.chat.completions.create(**kw, logprobs=True, top_logprobs=5)
    assert len(some.choices[0].logprobs.content[0].top_logprobs) == 5
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**kw, logprobs=True, top_logprobs=21)


def test_long_seed(client):
    for seed in (-(2**63) - 1, 2**63):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=SESSION, seed=seed, max_tokens=2)


def test_extra_fields_and_content_parts_and_custom_role_refused(client):
    kw = dict(model=MODEL, temperature=0, seed=0, max_tokens=6)
    extra = [{"role": "user", "content": "what is 1+1?", "extra_field": "0"}]
    assert client.chat.completions.create(**kw, messages=extra).choices[0].message.content
    as_text = [{"role": "user", "content": "what is 1+1?"}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "what is 1+1?"}]}]
    one = client.chat.completions.create(**kw, messages=as_text).choices[0].message.content
    two = client.chat.completions.create(**kw, messages=as_parts).choices[0].message.content
    assert one == two
    # vLLM passes a custom role to the chat template; blendkv refuses it as OpenAI does
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kw, messages=[{**as_text[0], "role": "my-custom-role"}])
    assert err.value.body["param"] == "messages"


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 5},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_json_object(client):
    kw = dict(model=MODEL, messages=SESSION, max_completion_tokens=40, temperature=1.0, n=2)
    assert client.chat.completions.create(**kw, response_format={"type": "text"}).choices
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    for choice in client.chat.completions.create(**kw, response_format=fmt, seed=1).choices:
        value = json.loads(choice.message.content)
        assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 5
    # The mask keeps the text an object; whether a random model closes it within max tokens is
    # chance (tests/engine/test_structured_output.py biases it to close and parses it).
    obj = client.chat.completions.create(
        **{**kw, "n": 1, "temperature": 0, "max_completion_tokens": 60},
        response_format={"type": "json_object"},
    )
    text = obj.choices[0].message.content
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    for fmt in (
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "grammar"},
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kw, response_format=fmt)
        assert err.value.body["param"] == "response_format"


def test_structured_outputs_choice_regex_and_json(client):
    choices = ["Paris", "Berlin", "New York"]
    kw = dict(model=MODEL, max_tokens=20, temperature=1.0)
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        c = client.completions.create(**kw, prompt="The capital is", n=3, extra_body=body)
        assert all(ch.text in choices for ch in c.choices)
    c = client.chat.completions.create(
        **kw, messages=SESSION, extra_body={"guided_regex": "[a-c]{2}-[0-9]{2}"}
    )
    assert re.fullmatch("[a-c]{2}-[0-9]{2}", c.choices[0].message.content)
    c = client.completions.create(
        **{**kw, "max_tokens": 80},
        prompt="JSON:",
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )
    assert c.choices[0].finish_reason == "stop"
    assert json.loads(c.choices[0].text)["answer"] in ("yes", "no")
    for body, param in (
        ({"guided_regex": "(("}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**kw, prompt="x", extra_body=body)
        assert err.value.body["param"] == param, body


@pytest.mark.skip(reason="tool calling is refused (400)")
def test_tools():
    pass
