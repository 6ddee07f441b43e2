"""Strict request validation, red-teamed against the real server: values OpenAI and vLLM refuse
(integers as strings or booleans, ``max_tokens`` beyond the context, a ``stream`` that is not a
boolean, ``temperature`` outside [0, 2], ``top_p`` outside (0, 1], unknown roles, ``blend``
options that cannot apply, ...) each get a 400 naming the parameter, never a 200 or a 5xx, and
are refused before anything is queued; the valid edge values still pass."""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
from helpers import QuietLLM
from server_helpers import make_tiny_chat_model_dir, raw_request, running_server, scrape

from blendkv.entrypoints.openai.api_server import ServeConfig, create_app

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
MAX_MODEL_LEN = 64
NUM_LAYERS = 3  # the tiny model's (tests/helpers.py)
ENGINE = dict(
    dtype="float32",
    block_size=4,
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=8,
    attention_backend="torch",
)
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
COMPLETION = {"model": MODEL, "prompt": "fox", "max_tokens": 1}
HELLO = [{"role": "user", "content": "Hi"}]
MESSAGES = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
DOCS = {**MESSAGES, "documents": [{"text": "Paris is in France."}]}
NAN, INF = float("nan"), float("inf")


class Bad(NamedTuple):
    """A malformed body: the 400's ``param`` and what its message must name besides."""

    route: str
    body: dict
    param: str
    names: str | None = None


def cmpl(**fields) -> dict:
    return {**COMPLETION, **fields}


def chat(**fields) -> dict:
    return {**MESSAGES, **fields}


def blend(**options) -> dict:
    return {**DOCS, "blend": options}


def role(name) -> dict:
    return chat(messages=[{"role": name, "content": "Hi"}])


TEN = list(range(5, 15))  # a prompt of 10 token ids
V = "v_deviation"
INVALID = {
    # integers given as strings, booleans or floats
    "cmpl max_tokens '10'": Bad(CMPL, cmpl(max_tokens="10"), "max_tokens"),
    "cmpl max_tokens true": Bad(CMPL, cmpl(max_tokens=True), "max_tokens"),
    "cmpl max_tokens 1.5": Bad(CMPL, cmpl(max_tokens=1.5), "max_tokens"),
    "chat max_tokens '10'": Bad(CHAT, chat(max_tokens="10"), "max_tokens"),
    "chat max_tokens true": Bad(CHAT, chat(max_tokens=True), "max_tokens"),
    "chat max_completion_tokens '8'": Bad(
        CHAT, chat(max_completion_tokens="8"), "max_completion_tokens"
    ),
    "chat max_completion_tokens false": Bad(
        CHAT, chat(max_completion_tokens=False), "max_completion_tokens"
    ),
    "cmpl n '1'": Bad(CMPL, cmpl(n="1"), "n"),
    "chat n true": Bad(CHAT, chat(n=True), "n"),
    "cmpl top_k '5'": Bad(CMPL, cmpl(top_k="5"), "top_k"),
    "chat top_k true": Bad(CHAT, chat(top_k=True), "top_k"),
    "cmpl seed '42'": Bad(CMPL, cmpl(seed="42"), "seed"),
    "chat seed true": Bad(CHAT, chat(seed=True), "seed"),
    "chat seed 1.0": Bad(CHAT, chat(seed=1.0), "seed"),
    "cmpl min_tokens '1'": Bad(CMPL, cmpl(min_tokens="1"), "min_tokens"),
    "cmpl logprobs '1'": Bad(CMPL, cmpl(logprobs="1"), "logprobs"),
    "cmpl logprobs true": Bad(CMPL, cmpl(logprobs=True), "logprobs"),
    "chat top_logprobs '2'": Bad(CHAT, chat(logprobs=True, top_logprobs="2"), "top_logprobs"),
    "cmpl best_of '1'": Bad(CMPL, cmpl(best_of="1"), "best_of"),
    "cmpl stop_token_ids ['5']": Bad(CMPL, cmpl(stop_token_ids=["5"]), "stop_token_ids"),
    "cmpl stop_token_ids [true]": Bad(CMPL, cmpl(stop_token_ids=[True]), "stop_token_ids"),
    "cmpl prompt [true, false]": Bad(CMPL, cmpl(prompt=[True, False]), "prompt"),
    "cmpl prompt [[true]]": Bad(CMPL, cmpl(prompt=[[True]]), "prompt"),
    "cmpl prompt 5": Bad(CMPL, cmpl(prompt=5), "prompt"),
    "chat rag.top_k '2'": Bad(CHAT, chat(rag={"top_k": "2"}), "rag", "top_k"),
    "chat rag.top_k 0": Bad(CHAT, chat(rag={"top_k": 0}), "rag", "top_k"),
    "blend.check_layer '1'": Bad(CHAT, blend(check_layer="1"), "blend", "check_layer"),
    "blend.chunk_samples true": Bad(CHAT, blend(chunk_samples=True), "blend", "chunk_samples"),
    "blend.reselect '1'": Bad(CHAT, blend(reselect="1"), "blend", "reselect"),
    "blend.schedule [['2', 0.05]]": Bad(
        CHAT, blend(selection=V, schedule=[["2", 0.05]]), "blend", "schedule"
    ),
    # max_tokens beyond the context: before tokenising, then after
    "cmpl max_tokens 2**63": Bad(CMPL, cmpl(max_tokens=2**63), "max_tokens"),
    "cmpl max_tokens 10**30": Bad(CMPL, cmpl(max_tokens=10**30), "max_tokens"),
    "chat max_tokens 2**63": Bad(CHAT, chat(max_tokens=2**63), "max_tokens"),
    "chat max_completion_tokens 10**30": Bad(
        CHAT, chat(max_completion_tokens=10**30), "max_completion_tokens"
    ),
    "cmpl max_tokens = max_model_len": Bad(CMPL, cmpl(max_tokens=MAX_MODEL_LEN), "max_tokens"),
    "cmpl max_tokens past 10 prompt tokens": Bad(
        CMPL, cmpl(prompt=TEN, max_tokens=MAX_MODEL_LEN - 9), "max_tokens"
    ),
    "chat max_tokens past the template": Bad(
        CHAT, chat(max_tokens=MAX_MODEL_LEN - 4), "max_tokens"
    ),
    "blended max_tokens past the documents": Bad(
        CHAT, {**DOCS, "max_tokens": MAX_MODEL_LEN - 8}, "max_tokens"
    ),
    # stream that is not a boolean
    "cmpl stream 'yes'": Bad(CMPL, cmpl(stream="yes"), "stream"),
    "cmpl stream 'true'": Bad(CMPL, cmpl(stream="true"), "stream"),
    "chat stream 'yes'": Bad(CHAT, chat(stream="yes"), "stream"),
    "chat stream 1": Bad(CHAT, chat(stream=1), "stream"),
    "chat stream_options.include_usage 'yes'": Bad(
        CHAT,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options",
        "include_usage",
    ),
    # temperature outside [0, 2], top_p outside (0, 1], numbers as strings or booleans
    "cmpl temperature 1e9": Bad(CMPL, cmpl(temperature=1e9), "temperature"),
    "chat temperature 2.0001": Bad(CHAT, chat(temperature=2.0001), "temperature"),
    "chat temperature -0.1": Bad(CHAT, chat(temperature=-0.1), "temperature"),
    "cmpl temperature '0.5'": Bad(CMPL, cmpl(temperature="0.5"), "temperature"),
    "chat temperature true": Bad(CHAT, chat(temperature=True), "temperature"),
    "cmpl temperature NaN": Bad(CMPL, cmpl(temperature=NAN), "temperature"),
    "chat temperature Infinity": Bad(CHAT, chat(temperature=INF), "temperature"),
    "cmpl top_p 0": Bad(CMPL, cmpl(top_p=0), "top_p"),
    "chat top_p 1.5": Bad(CHAT, chat(top_p=1.5), "top_p"),
    "chat top_p -1": Bad(CHAT, chat(top_p=-1), "top_p"),
    "cmpl top_p '0.9'": Bad(CMPL, cmpl(top_p="0.9"), "top_p"),
    "cmpl top_p NaN": Bad(CMPL, cmpl(top_p=NAN), "top_p"),
    "cmpl presence_penalty '1'": Bad(CMPL, cmpl(presence_penalty="1"), "presence_penalty"),
    "chat frequency_penalty true": Bad(CHAT, chat(frequency_penalty=True), "frequency_penalty"),
    "chat frequency_penalty NaN": Bad(CHAT, chat(frequency_penalty=NAN), "frequency_penalty"),
    "cmpl min_p 2": Bad(CMPL, cmpl(min_p=2), "min_p"),
    "chat repetition_penalty '1.1'": Bad(
        CHAT, chat(repetition_penalty="1.1"), "repetition_penalty"
    ),
    "cmpl logit_bias value '1'": Bad(CMPL, cmpl(logit_bias={"5": "1"}), "logit_bias"),
    "cmpl logit_bias value 1e308": Bad(CMPL, cmpl(logit_bias={"5": 1e308}), "logit_bias"),
    # booleans given as anything else
    "cmpl ignore_eos 'yes'": Bad(CMPL, cmpl(ignore_eos="yes"), "ignore_eos"),
    "chat skip_special_tokens 0": Bad(CHAT, chat(skip_special_tokens=0), "skip_special_tokens"),
    "cmpl echo 'no'": Bad(CMPL, cmpl(echo="no"), "echo"),
    "chat logprobs 'true'": Bad(CHAT, chat(logprobs="true"), "logprobs"),
    "cmpl include_stop_str_in_output 1": Bad(
        CMPL, cmpl(include_stop_str_in_output=1), "include_stop_str_in_output"
    ),
    # unknown roles
    "role wizard": Bad(CHAT, role("wizard"), "messages", "role"),
    "role with a lone surrogate": Bad(CHAT, role("us\ud800er"), "messages", "role"),
    "role function": Bad(CHAT, role("function"), "messages", "role"),
    "role ''": Bad(CHAT, role(""), "messages", "role"),
    "role USER": Bad(CHAT, role("USER"), "messages", "role"),
    "role 1": Bad(CHAT, role(1), "messages", "role"),
    "role null": Bad(CHAT, role(None), "messages", "role"),
    "role wizard in a conversation with documents": Bad(
        CHAT,
        {**DOCS, "messages": [*HELLO, {"role": "wizard", "content": "x"}, *HELLO]},
        "messages",
        "role",
    ),
    "content 5": Bad(CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages"),
    "document text 5": Bad(CHAT, {**DOCS, "documents": [{"text": 5}]}, "documents", "text"),
    # blend options that cannot apply
    "blend.check_layer 999": Bad(CHAT, blend(check_layer=999), "blend", "check_layer"),
    "blend.check_layer 999 v_deviation": Bad(
        CHAT, blend(check_layer=999, selection=V), "blend", "check_layer"
    ),
    "blend.check_layer = num_layers": Bad(
        CHAT, blend(check_layer=NUM_LAYERS, selection=V), "blend", "check_layer"
    ),
    "blend.schedule past the last layer": Bad(
        CHAT, blend(selection=V, schedule=[[999, 0.05]]), "blend", "999"
    ),
    "blend.check_layer 2 with prophet": Bad(CHAT, blend(check_layer=2), "blend", "check_layer"),
    "blend.check_layer 2 at full reuse": Bad(
        CHAT, blend(recompute_ratio=0, selection=V, check_layer=2), "blend", "check_layer"
    ),
    "blend.min_recompute_ratio without auto": Bad(
        CHAT, blend(min_recompute_ratio=0.2), "blend", "min_recompute_ratio"
    ),
    "blend.correction_shrink without a correction": Bad(
        CHAT, blend(correction="none", correction_shrink=8), "blend", "correction_shrink"
    ),
    "blend.recompute_ratio '0.5'": Bad(
        CHAT, blend(recompute_ratio="0.5"), "blend", "recompute_ratio"
    ),
    "blend.skip_exact 'yes'": Bad(CHAT, blend(skip_exact="yes"), "blend", "skip_exact"),
    "blend.recompute_ratio NaN": Bad(CHAT, blend(recompute_ratio=NAN), "blend", "recompute_ratio"),
    "blend.correction_shrink Infinity": Bad(
        CHAT, blend(correction_shrink=INF), "blend", "correction_shrink"
    ),
    "cmpl logit_bias value NaN": Bad(CMPL, cmpl(logit_bias={"5": NAN}), "logit_bias"),
    "chat presence_penalty Infinity": Bad(CHAT, chat(presence_penalty=INF), "presence_penalty"),
    "blend.seed 10**30": Bad(CHAT, blend(selection="random", seed=10**30), "blend", "seed"),
    "blend.fidelity_target -1": Bad(CHAT, blend(fidelity_target=-1), "blend", "fidelity_target"),
    "blend ratio and fidelity_target": Bad(
        CHAT, blend(recompute_ratio=0.2, fidelity_target=0.1), "blend", "fidelity_target"
    ),
    "blend without documents": Bad(CHAT, chat(blend={"recompute_ratio": 0.2}), "blend"),
    # huge integers where a small one is meant
    "cmpl top_k 10**30": Bad(CMPL, cmpl(top_k=10**30), "top_k"),
    "cmpl n 10**30": Bad(CMPL, cmpl(n=10**30), "n"),
    "cmpl min_tokens 10**30": Bad(CMPL, cmpl(min_tokens=10**30), "min_tokens"),
    "cmpl logprobs 10**30": Bad(CMPL, cmpl(logprobs=10**30), "logprobs"),
    "chat top_logprobs 10**30": Bad(CHAT, chat(logprobs=True, top_logprobs=10**30), "top_logprobs"),
    "cmpl stop_token_ids [10**30]": Bad(CMPL, cmpl(stop_token_ids=[10**30]), "stop_token_ids"),
    "cmpl logit_bias key 10**30": Bad(CMPL, cmpl(logit_bias={str(10**30): 1}), "logit_bias"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_chat_model_dir(tmp_path_factory.mktemp("tiny-chat"))
    app = create_app(
        lambda: QuietLLM(str(model_dir), **ENGINE), ServeConfig(served_model_name=MODEL)
    )
    with running_server(app) as url:
        yield url


def post(url: str, path: str, body: dict) -> tuple[int, dict | str]:
    data = json.dumps(body).encode()  # NaN and Infinity as Python writes them; \ud800 escaped
    status, _, answer = raw_request(url, "POST", path, data)
    return status, answer


def finished(url: str) -> float:
    return sum(v for k, v in scrape(url).items() if k.startswith("blendkv_requests_finished"))


def test_the_red_team_table_is_large():
    assert len(INVALID) >= 60


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_value_is_a_400_naming_the_parameter(server, case):
    path, body, param, names = INVALID[case]
    before = finished(server)
    status, answer = post(server, path, body)
    assert status == 400, (status, str(answer)[:300])
    error = answer["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert (names or param) in error["message"], error
    assert finished(server) == before  # refused before it was queued


def prompt_tokens(url: str, path: str, body: dict) -> int:
    status, answer = post(url, path, {**body, "max_tokens": 1})
    assert status == 200, answer
    return answer["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CMPL, COMPLETION, "max_tokens"),
        (CMPL, {**COMPLETION, "prompt": list(range(5, 15))}, "max_tokens"),
        (CHAT, MESSAGES, "max_tokens"),
        (CHAT, MESSAGES, "max_completion_tokens"),
        (CHAT, DOCS, "max_tokens"),
    ],
)
def test_max_tokens_of_the_room_left_passes_one_more_does_not(server, path, body, field):
    room = MAX_MODEL_LEN - prompt_tokens(server, path, body)
    body = {k: v for k, v in body.items() if k != "max_tokens"}
    status, answer = post(server, path, {**body, field: room, "ignore_eos": True})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == room
    status, answer = post(server, path, {**body, field: room + 1})
    assert status == 400 and answer["error"]["param"] == field, answer
    assert f"{room + 1} > {MAX_MODEL_LEN} - {MAX_MODEL_LEN - room}" in answer["error"]["message"]


VALID = {
    "temperature 0": (CMPL, cmpl(temperature=0)),
    "blend.fidelity_target 0.1": (CHAT, blend(fidelity_target=0.1)),
    "temperature 2": (CHAT, chat(temperature=2)),
    "temperature 2.0": (CMPL, cmpl(temperature=2.0)),
    "temperature 1 (an integer)": (CHAT, chat(temperature=1)),
    "top_p 1": (CMPL, cmpl(top_p=1)),
    "top_p 1e-9": (CHAT, chat(top_p=1e-9)),
    "stream false": (CMPL, cmpl(stream=False)),
    "stream null": (CHAT, chat(stream=None)),
    "logprobs null": (CHAT, chat(logprobs=None)),
    "max_tokens null": (CMPL, cmpl(prompt="fox " * 10, max_tokens=None)),
    "presence_penalty 2 (an integer)": (CHAT, chat(presence_penalty=2)),
    "logit_bias 100 (an integer)": (CMPL, cmpl(logit_bias={"5": 100})),
    **{
        f"role {name}": (CHAT, chat(messages=[{"role": name, "content": "Hi"}, *HELLO]))
        for name in ("system", "developer", "user", "assistant", "tool")
    },
    "blend.check_layer = num_layers - 1": (CHAT, blend(check_layer=NUM_LAYERS - 1, selection=V)),
    "blend.check_layer at its default with prophet": (CHAT, blend(check_layer=1)),
    "blend.schedule within the layers": (CHAT, blend(selection=V, schedule=[[2, 0.05]])),
    "blend auto ratio with bounds": (CHAT, blend(recompute_ratio="auto", min_recompute_ratio=0.2)),
}


# Odd but valid: never a 5xx (a huge number of chunk head tokens recomputes every chunk row).
ODD = {
    "blend.chunk_head_tokens 10**30": (CHAT, blend(chunk_head_tokens=10**30)),
    "blend.chunk_samples 10**30": (CHAT, blend(chunk_samples=10**30)),
    "blend.seed -2**63": (CHAT, blend(selection="random", seed=-(2**63))),
    "cmpl top_k 2**63 - 1": (CMPL, cmpl(top_k=2**63 - 1)),
    "cmpl min_tokens = max_tokens": (CMPL, cmpl(min_tokens=1)),
    "cmpl seed 2**63 - 1": (CMPL, cmpl(seed=2**63 - 1)),
}


@pytest.mark.parametrize("case", list(ODD))
def test_odd_value_is_never_a_5xx(server, case):
    path, body = ODD[case]
    status, answer = post(server, path, body)
    assert status in (200, 400), (status, answer)


@pytest.mark.parametrize("case", list(VALID))
def test_valid_edge_value_passes(server, case):
    path, body = VALID[case]
    status, answer = post(server, path, body)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] is not None
