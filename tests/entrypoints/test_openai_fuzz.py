"""Hostile strings in every string field of every route: lone surrogates (JSON ``\\ud800``
escapes), NULs and 1 MB strings get a 200 or a 4xx with an OpenAI error body, never a 5xx, and
the server keeps serving."""

from __future__ import annotations

import copy
import json
import urllib.parse

import pytest
from helpers import QuietLLM
from server_helpers import make_tiny_chat_model_dir, port_of, raw_request, running_server

from blendkv.entrypoints.openai.api_server import ServeConfig, create_app

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
ENGINE = dict(
    dtype="float32", block_size=4, max_model_len=256, max_num_seqs=8, attention_backend="torch"
)
VALUES = {
    "surrogate": "a\ud800b\udfffc",
    "nul": "a\x00b",
    "1MB": "ab" * 500_000,
}
COMPLETION = {"model": MODEL, "prompt": "fox", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
DOCS = {**CHAT, "documents": [{"text": "Paris is in France.", "title": "Paris"}]}
# (route, base body, path to the string field); "*key" puts the value in an object key.
FIELDS = {
    "completions.model": ("/v1/completions", COMPLETION, ["model"]),
    "completions.prompt": ("/v1/completions", COMPLETION, ["prompt"]),
    "completions.prompt[0]": ("/v1/completions", {**COMPLETION, "prompt": ["x"]}, ["prompt", 0]),
    "completions.stop": ("/v1/completions", {**COMPLETION, "stop": "x"}, ["stop"]),
    "completions.stop[0]": ("/v1/completions", {**COMPLETION, "stop": ["x"]}, ["stop", 0]),
    "completions.user": ("/v1/completions", {**COMPLETION, "user": "x"}, ["user"]),
    "completions.suffix": ("/v1/completions", {**COMPLETION, "suffix": "x"}, ["suffix"]),
    "completions.logit_bias key": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {}},
        ["logit_bias", "*key"],
    ),
    "completions.unknown field": ("/v1/completions", {**COMPLETION, "zzz": "x"}, ["zzz"]),
    "chat.model": ("/v1/chat/completions", CHAT, ["model"]),
    "chat.role": ("/v1/chat/completions", CHAT, ["messages", 0, "role"]),
    "chat.content": ("/v1/chat/completions", CHAT, ["messages", 0, "content"]),
    "chat.name": ("/v1/chat/completions", CHAT, ["messages", 0, "name"]),
    "chat.content part text": (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
        ["messages", 0, "content", 0, "text"],
    ),
    "chat.content part type": (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
        ["messages", 0, "content", 0, "type"],
    ),
    "chat.system content": (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "system", "content": "x"}, *CHAT["messages"]]},
        ["messages", 0, "content"],
    ),
    "chat.stop": ("/v1/chat/completions", {**CHAT, "stop": ["x"]}, ["stop", 0]),
    "chat.user": ("/v1/chat/completions", {**CHAT, "user": "x"}, ["user"]),
    "chat.response_format": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "x"}},
        ["response_format", "type"],
    ),
    "chat.tools": (
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "x"}]},
        ["tools", 0, "type"],
    ),
    "chat.documents text": ("/v1/chat/completions", DOCS, ["documents", 0, "text"]),
    "chat.documents title": ("/v1/chat/completions", DOCS, ["documents", 0, "title"]),
    "chat.documents query": ("/v1/chat/completions", DOCS, ["messages", 0, "content"]),
    "chat.documents role": ("/v1/chat/completions", DOCS, ["messages", 0, "role"]),
    "chat.blend selection": (
        "/v1/chat/completions",
        {**DOCS, "blend": {"selection": "x"}},
        ["blend", "selection"],
    ),
    "chat.blend key": ("/v1/chat/completions", {**DOCS, "blend": {}}, ["blend", "*key"]),
    "chat.rag chunk_order": (
        "/v1/chat/completions",
        {**CHAT, "rag": {"chunk_order": "x"}},
        ["rag", "chunk_order"],
    ),
    "chat.rag filter": (
        "/v1/chat/completions",
        {**CHAT, "rag": {"filter": {"source": "x"}}},
        ["rag", "filter", "source"],
    ),
}


def with_value(body: dict, path: list, value: str) -> dict:
    body = copy.deepcopy(body)
    target = body
    for step in path[:-1]:
        target = target[step]
    if path[-1] == "*key":
        target[value] = 1
    else:
        target[path[-1]] = value
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_chat_model_dir(tmp_path_factory.mktemp("tiny-chat"))
    app = create_app(
        lambda: QuietLLM(str(model_dir), **ENGINE), ServeConfig(served_model_name=MODEL)
    )
    with running_server(app) as url:
        yield url


def check_answer(status: int, headers: dict, body) -> None:
    assert status == 200 or 400 <= status < 500, (status, str(body)[:300])
    assert headers.get("x-request-id")
    if status != 200:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


@pytest.mark.parametrize("kind", sorted(VALUES))
@pytest.mark.parametrize("field", sorted(FIELDS))
def test_hostile_string_in_each_field_is_never_a_5xx(server, field, kind):
    path, base, where = FIELDS[field]
    body = json.dumps(with_value(base, where, VALUES[kind])).encode()  # lone surrogates: \ud800
    check_answer(*raw_request(server, "POST", path, body))


@pytest.mark.parametrize("kind", ["surrogate", "nul"])
def test_hostile_model_id_in_the_path(server, kind):
    encoded = urllib.parse.quote(VALUES[kind].encode("utf-8", "surrogatepass"), safe="")
    check_answer(*raw_request(server, "GET", f"/v1/models/{encoded}"))


def test_the_server_still_serves(server):
    status, _, body = raw_request(server, "POST", "/v1/completions", COMPLETION)
    assert status == 200 and body["choices"][0]["finish_reason"], body
    assert port_of(server) > 0
