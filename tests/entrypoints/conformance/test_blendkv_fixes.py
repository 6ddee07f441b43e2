"""OpenAI/vLLM conformance of the server, driven by the official ``openai`` client: the seed
range, ``stream_options``, logprobs (the sampled token in its own entry, real bytes, no merged
keys), error bodies (``param``, vLLM's empty-prompt text, ``x-request-id`` everywhere),
``GET /v1/models/{id}``, ``GET /version``, continuous usage, the finish chunk's text."""

from __future__ import annotations

import json

import openai
import pytest
from helpers import make_tokenizer
from server_helpers import raw_request

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"  # conftest.py's server
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello"}]
EMOJI = "😀"


def test_seed_outside_int64_is_refused(server, client):
    for seed in (2**63, -(2**63) - 1):
        for path, body in (("/v1/completions", {"prompt": "fox"}), (CHAT, {"messages": HELLO})):
            status, _, err = raw_request(server, "POST", path, {**body, "seed": seed})
            assert status == 400 and err["error"]["param"] == "seed", err
    ok = client.completions.create(model=MODEL, prompt="fox", max_tokens=2, seed=2**63 - 1)
    assert ok.choices[0].finish_reason is not None


def test_stream_options_need_stream(server):
    for path, body in (("/v1/completions", {"prompt": "fox"}), (CHAT, {"messages": HELLO})):
        for stream in (False, None):
            req = {**body, "stream_options": {"include_usage": True}}
            if stream is not None:
                req["stream"] = stream
            status, _, err = raw_request(server, "POST", path, req)
            assert status == 400 and err["error"]["param"] == "stream_options", err


def test_completion_logprobs_hold_the_sampled_token(client):
    kw = dict(model=MODEL, prompt="The quick", max_tokens=12, temperature=1.5, seed=3)
    one = client.completions.create(**kw, logprobs=1, extra_body={"ignore_eos": True})
    lp = one.choices[0].logprobs
    assert len(lp.tokens) == 12
    off_top = 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(value)  # the sampled token is in its own entry
        assert len(top) in (1, 2)
        off_top += len(top) == 2
    assert off_top > 0, "at temperature 1.5 some sampled token is not the most likely one"
    zero = client.completions.create(**kw, logprobs=0, extra_body={"ignore_eos": True})
    lp0 = zero.choices[0].logprobs
    assert lp0.tokens == lp.tokens  # the same seed, the same tokens
    assert lp0.top_logprobs == [{t: v} for t, v in zip(lp0.tokens, lp0.token_logprobs, strict=True)]


@pytest.fixture(scope="module")
def emoji_ids() -> dict[int, int]:
    """token id -> the byte it stands for, for the four byte tokens of an emoji."""
    tok = make_tokenizer(320)  # the tiny model's tokenizer
    ids = tok.encode(EMOJI, add_special_tokens=False)
    assert len(ids) == 4 and len(set(ids)) == 4, ids
    return dict(zip(ids, EMOJI.encode(), strict=True))


def test_logprobs_report_each_byte_tokens_real_bytes(client, emoji_ids):
    bias = {str(t): 100 for t in emoji_ids}  # only the emoji's byte tokens can be sampled
    kw = dict(model=MODEL, max_tokens=6, temperature=0, logit_bias=bias)
    resp = client.chat.completions.create(
        **kw,
        messages=HELLO,
        logprobs=True,
        top_logprobs=4,
        extra_body={"return_tokens_as_token_ids": True},
    )
    for item in resp.choices[0].logprobs.content:
        tid = int(item.token.removeprefix("token_id:"))
        assert item.bytes == [emoji_ids[tid]]  # not U+FFFD's [239, 191, 189]
        # The model's own top 4 (logprobs ignore logit_bias): 4 distinct tokens, real bytes.
        tops = {int(t.token.removeprefix("token_id:")): t.bytes for t in item.top_logprobs}
        assert len(tops) == 4 and [239, 191, 189] not in tops.values()
    plain = client.chat.completions.create(**kw, messages=HELLO, logprobs=True)
    for item in plain.choices[0].logprobs.content:
        assert item.token == "".join(f"\\x{b:02x}" for b in item.bytes)  # OpenAI's escapes
    # Completions key top_logprobs by token string: distinct tokens are never merged.
    comp = client.completions.create(**kw, prompt="fox", logprobs=4)
    lp = comp.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) in (4, 5) and top[token] == pytest.approx(value)
        assert token in {f"\\x{b:02x}" for b in emoji_ids.values()}


def test_error_bodies_name_the_parameter_and_carry_a_request_id(server):
    cases = [
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": [[1], [2]]}, "prompt"),
        (CHAT, {"messages": HELLO, "response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/completions", {"prompt": "fox", "stop_token_ids": [100_000]}, "stop_token_ids"),
        (CHAT, {"messages": HELLO, "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": [5, 99_999]}, "prompt"),
    ]
    for path, body, param in cases:
        status, headers, err = raw_request(server, "POST", path, body)
        assert status == 400, err
        assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
        assert headers["x-request-id"]
    status, _, err = raw_request(server, "POST", "/v1/completions", {"prompt": [5, 99_999]})
    assert "out of vocabulary" in err["error"]["message"]
    for path, method in (("/nope", "GET"), ("/v1/models", "POST"), ("/health", "GET")):
        status, headers, _ = raw_request(server, method, path)
        assert status in (200, 404, 405) and len(headers["x-request-id"]) >= 16
    status, headers, body = raw_request(server, "POST", "/v1/completions", b"{not json")
    assert status == 400 and headers["x-request-id"]


def test_empty_prompt_error_is_vllms(client):
    for prompt in ("", []):
        with pytest.raises(openai.BadRequestError, match="decoder prompt cannot be empty"):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)


def test_models_retrieve_and_version(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    status, _, body = raw_request(server, "GET", "/version")
    assert status == 200 and body["version"]


def test_streamed_chat_finish_chunk_carries_the_last_text(client):
    kw = dict(model=MODEL, messages=HELLO, max_completion_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    texts, finishes = [], []
    for chunk in client.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}):
        delta = chunk.choices[0].delta
        texts.append(delta.content or "")
        if chunk.choices[0].finish_reason is not None:
            finishes.append((chunk.choices[0].finish_reason, delta.content))
    assert len(finishes) == 1 and finishes[0][0] == full.choices[0].finish_reason == "length"
    assert finishes[0][1]  # vLLM's test_chat_streaming reads the text of the finish chunk
    assert "".join(texts) == full.choices[0].message.content


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_in_every_chunk(client, route):
    kw = dict(model=MODEL, max_tokens=8, temperature=0, stream=True, extra_body={"min_tokens": 8})
    if route == "chat":
        create, kw = client.chat.completions.create, {**kw, "messages": HELLO}
    else:
        create, kw = client.completions.create, {**kw, "prompt": "The quick"}
    chunks = list(
        create(**kw, stream_options={"include_usage": True, "continuous_usage_stats": True})
    )
    last = 0
    for chunk in chunks:
        u = chunk.usage
        assert u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert (
            last == 0
            or u.completion_tokens > last
            or (not chunk.choices and u.completion_tokens == last)
        )
        last = u.completion_tokens
    assert last == 8 and chunks[-1].choices == []
    only_final = list(create(**kw, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in only_final[:-1]) and only_final[-1].usage is not None
    assert all(c.usage is None for c in create(**kw))


def test_body_of_a_json_error_is_json(server):
    status, headers, body = raw_request(server, "POST", CHAT, {"messages": []})
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.dumps(body) and body["error"]["param"] == "messages"


UNSUPPORTED = {
    "truncate_prompt_tokens": 8,
    "use_beam_search": True,
    "guided_grammar": "root ::= 'a'",
}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_features_not_built_are_refused_naming_the_parameter(server, route):
    base = {"prompt": "fox"} if route == "completions" else {"messages": HELLO}
    url = "/v1/completions" if route == "completions" else CHAT
    cases = dict(UNSUPPORTED)
    if route == "chat":
        cases.update(echo=True, tool_choice="auto", response_format={"type": "json_schema"})
    for name, value in cases.items():
        status, _, err = raw_request(server, "POST", url, {**base, name: value})
        assert status == 400 and err["error"]["param"] == name, (name, err)
    for path in ("/invocations", "/load"):
        status, _, err = raw_request(server, "POST", path, base)
        assert status == 400 and path[1:] in err["error"]["message"]
    ok = {**base, "prompt_logprobs": None, "use_beam_search": False, "max_tokens": 1}
    assert raw_request(server, "POST", url, ok)[0] == 200
