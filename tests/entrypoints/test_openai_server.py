"""The real server (uvicorn on 127.0.0.1, tiny random model with a simple chat template) driven
by the official ``openai`` client, LangChain's ``ChatOpenAI`` and raw HTTP."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import QuietLLM
from server_helpers import (
    make_tiny_chat_model_dir,
    open_stream,
    port_of,
    raw_request,
    running_server,
    scrape,
    wait_for,
)

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.entrypoints.openai.api_server import ServeConfig, create_app
from blendkv.guards.calibration import UNCALIBRATED_RATIO

pytestmark = pytest.mark.timeout(300)

API_KEY = "test-key"
MODEL = "tiny"
ENGINE = dict(dtype="float32", block_size=4, max_model_len=256, max_num_seqs=32)
NO_EOS = {"ignore_eos": True}
DOCS = [
    "Paris is the capital of France. The Seine flows through Paris.",
    "Berlin is the capital of Germany. It has many museums and parks.",
]


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
    config = ServeConfig(api_key=API_KEY, served_model_name=MODEL)
    app = create_app(lambda: QuietLLM(str(model_dir), **ENGINE), config)
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_health_is_open_everything_else_needs_the_key(server, client):
    assert raw_request(server, "GET", "/health")[:1] == (200,)
    for key in (None, "wrong-key"):
        status, _, body = raw_request(server, "GET", "/v1/models", api_key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert raw_request(server, "GET", "/metrics", api_key=key)[0] == 401
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_matches_offline_greedy(client, offline):
    prompt = "The quick brown fox"
    ref = offline.generate(prompt, greedy(12, ignore_eos=True, logprobs=2))[0]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    choice = resp.choices[0]
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 12
    out = ref.outputs[0]
    ref_lps = [entry[t] for entry, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert choice.logprobs.token_logprobs == pytest.approx(ref_lps, abs=1e-4)
    # Token ids as the prompt give the same answer.
    by_ids = client.completions.create(
        model=MODEL, prompt=ref.prompt_token_ids, max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    assert by_ids.choices[0].text == ref.text


def test_penalties_and_logit_bias_match_offline(client, offline):
    prompt = "The quick brown fox"
    plain = offline.generate(prompt, greedy(16, ignore_eos=True))[0]
    bias = {7: 4.0, 9: -100.0}
    params = greedy(
        16,
        ignore_eos=True,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        logit_bias=bias,
    )
    ref = offline.generate(prompt, params)[0]
    assert ref.outputs[0].token_ids != plain.outputs[0].token_ids
    resp = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={**NO_EOS, "repetition_penalty": 1.3},
    )
    assert resp.choices[0].text == ref.text


def test_stop_string_ends_the_completion(client, offline):
    prompt = "The quick brown fox"
    text = offline.generate(prompt, greedy(12, ignore_eos=True))[0].text
    stop = text[4:6]  # a piece of the greedy answer
    ref = offline.generate(prompt, greedy(12, ignore_eos=True, stop=[stop]))[0]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop], extra_body=NO_EOS
    )
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason == "stop"
    assert resp.choices[0].text == ref.text and stop not in ref.text


def test_streamed_chat_equals_non_streamed(client, offline):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ]
    kw = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    assert full.choices[0].message.content == offline.chat(messages, greedy(16))[0].text
    for lp in full.choices[0].logprobs.content:  # greedy: the chosen token is the top one
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == full.choices[0].finish_reason and not any(reasons[:-1])
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int) -> str:
        resp = client.completions.create(
            model=MODEL,
            prompt="Paged attention",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body=NO_EOS,
        )
        return resp.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9), sample(10)}) > 1  # the seed is used


def test_every_blend_config_field_is_a_blend_option():
    """A ``BlendConfig`` field added without its ``BlendOptions`` field cannot be set over HTTP."""
    from blendkv.entrypoints.openai.protocol import BlendOptions, ChatCompletionRequest
    from blendkv.entrypoints.openai.serving import blend_config

    assert set(BlendOptions.model_fields) == {f.name for f in dataclasses.fields(BlendConfig)}
    options = {"correction": "kv", "correction_prior": "pooled", "correction_shrink": 8.0}
    req = ChatCompletionRequest(messages=HELLO, documents=[{"text": "x"}], blend=options)
    assert blend_config(req) == BlendConfig(**options)


@pytest.mark.parametrize(
    "options",
    [
        {"recompute_ratio": 0.3},
        {"recompute_ratio": 0.3, "correction": "kv", "correction_prior": "pooled", "reselect": 1},
    ],
    ids=["ratio", "correction"],
)
def test_documents_chat_equals_in_process_blended_generate(client, offline, options):
    query = "Which city is the capital of France?"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": query}],
        max_tokens=10,
        temperature=0,
        extra_body={"documents": [{"text": d} for d in DOCS], "blend": options},
    )
    resp = raw.parse()
    prompt = {"documents": DOCS, "query": query, "system": None}
    [ref] = offline.generate(prompt, greedy(10), blend=BlendConfig(**options))
    assert resp.choices[0].message.content == ref.text
    stats = resp.blendkv
    assert stats["num_chunks"] == 2 and stats["tokens_reused"] == ref.blend_stats.tokens_reused
    assert raw.headers["x-blendkv-num-chunks"] == "2"
    assert int(raw.headers["x-blendkv-tokens-reused"]) == stats["tokens_reused"] > 0


def test_sixteen_concurrent_streams_match_offline_and_share_steps(server, offline):
    conversations = [[{"role": "user", "content": f"Tell me about number {i}."}] for i in range(16)]
    refs = [o.text for o in offline.chat(conversations, greedy(24, ignore_eos=True))]
    start = threading.Barrier(len(conversations))
    before = scrape(server, API_KEY)

    def ask(messages) -> str:
        client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        start.wait(timeout=30)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body=NO_EOS,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(len(conversations)) as pool:
        answers = list(pool.map(ask, conversations, timeout=180))
    assert answers == refs
    after = scrape(server, API_KEY)
    assert after["blendkv_max_step_requests"] > 1
    # Steps in which more than one request got a token: observations above the le=1 bucket.
    multi = lambda m: m["blendkv_step_requests_count"] - m["blendkv_step_requests_bucket{le=1.0}"]  # noqa: E731
    assert multi(after) > multi(before)
    assert after["blendkv_kv_blocks_used"] == 0


def test_client_closing_mid_stream_aborts_its_request(server):
    before = scrape(server, API_KEY)
    conn, resp = open_stream(server, 200, model=MODEL, api_key=API_KEY)
    events = 0
    while events < 3:  # three tokens have arrived
        line = resp.readline()
        assert line, "the stream ended early"
        events += line.startswith(b"data: ")
    resp.close()
    conn.close()

    def aborted_and_free():
        m = scrape(server, API_KEY)
        done = m["blendkv_requests_aborted_total"] == before["blendkv_requests_aborted_total"] + 1
        return done and m["blendkv_kv_blocks_used"] == 0 and m["blendkv_num_requests_running"] == 0

    assert wait_for(aborted_and_free, timeout=30)
    after = scrape(server, API_KEY)
    finished = "blendkv_requests_finished_total{finish_reason=length}"
    assert after.get(finished) == before.get(finished)  # it never ran to its 200 tokens


def test_client_leaving_a_non_streamed_request_aborts_it(server):
    before = scrape(server, API_KEY)["blendkv_requests_aborted_total"]
    body = json.dumps(
        {"model": MODEL, "prompt": "fox", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as sock:
        sock.sendall(head + body)
        running = lambda: scrape(server, API_KEY)["blendkv_num_requests_running"] >= 1  # noqa: E731
        assert wait_for(running, timeout=30, interval=0.005)
    aborted = lambda: scrape(server, API_KEY)["blendkv_requests_aborted_total"] == before + 1  # noqa: E731
    assert wait_for(aborted, timeout=30)
    assert scrape(server, API_KEY)["blendkv_kv_blocks_used"] == 0


CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello"}]
BAD_REQUESTS = {
    "missing messages": (CHAT, {"model": MODEL}, 400, "messages"),
    "temperature -1": (CHAT, {"messages": HELLO, "temperature": -1}, 400, "temperature"),
    "max_tokens 0": (CHAT, {"messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
    "n 0": (CHAT, {"messages": HELLO, "n": 0}, 400, "n"),
    "n above max_num_seqs": (CHAT, {"messages": HELLO, "n": 33}, 400, "n"),
    "presence_penalty 3": (
        CHAT,
        {"messages": HELLO, "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    "repetition_penalty 0": (
        CHAT,
        {"messages": HELLO, "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    "logit_bias key": (CHAT, {"messages": HELLO, "logit_bias": {"fox": 1}}, 400, "logit_bias"),
    "logit_bias 101": (CHAT, {"messages": HELLO, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    "logit_bias id outside the vocab": (
        CHAT,
        {"messages": HELLO, "logit_bias": {"100000": 1}},
        400,
        "logit_bias",
    ),
    "unknown model": (CHAT, {"messages": HELLO, "model": "gpt-4o"}, 404, "model"),
    "over-long prompt": ("/v1/completions", {"prompt": "fox " * 400}, 413, None),
    "malformed JSON": (CHAT, b'{"messages": [', 400, None),
    "empty document": (CHAT, {"messages": HELLO, "documents": [{"text": ""}]}, 400, None),
    "bad blend ratio": (
        CHAT,
        {"messages": HELLO, "documents": [{"text": "x"}], "blend": {"recompute_ratio": 2}},
        400,
        "blend",
    ),
    "bad correction prior": (
        CHAT,
        {"messages": HELLO, "documents": [{"text": "x"}], "blend": {"correction_prior": "mean"}},
        400,
        "blend",
    ),
    "misspelt blend field": (
        CHAT,
        {"messages": HELLO, "documents": [{"text": "x"}], "blend": {"ratio": 0.1}},
        400,
        "blend",
    ),
    "rag without a store": (CHAT, {"messages": HELLO, "rag": {"top_k": 2}}, 400, "rag"),
    "documents to completions": (
        "/v1/completions",
        {"prompt": "x", "documents": [{"text": "y"}]},
        400,
        "documents",
    ),
    "20 MB body": (
        CHAT,
        {"messages": [{"role": "user", "content": "a" * 20_000_000}]},
        413,
        None,
    ),
    "wrong API key": (CHAT, {"messages": HELLO}, 401, None),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, client, case):
    path, body, status, param = BAD_REQUESTS[case]
    key = "nope" if case == "wrong API key" else API_KEY
    got, headers, error = raw_request(server, "POST", path, body, api_key=key)
    assert got == status, error
    assert headers["content-type"] == "application/json"
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["message"]
    assert error["error"]["param"] == param
    if case == "20 MB body":  # refused by the size limit, not by the tokenizer
        assert error["error"]["code"] == "request_too_large"
    good = client.completions.create(model=MODEL, prompt="fox", max_tokens=3, temperature=0)
    assert good.choices[0].finish_reason is not None


def test_metrics_parse_and_move(server, client):
    before = scrape(server, API_KEY)
    client.completions.create(
        model=MODEL, prompt="The quick", max_tokens=5, temperature=0, extra_body=NO_EOS
    )
    client.chat.completions.create(  # documents of its own: no earlier blend is in the cache
        model=MODEL,
        messages=HELLO,
        max_tokens=2,
        extra_body={"documents": [{"text": f"{d} (metrics)"} for d in DOCS]},
    )
    after = scrape(server, API_KEY)
    ok = "blendkv_http_requests_total{route=/v1/completions,status=200}"
    assert after[ok] == before.get(ok, 0) + 1
    assert after["blendkv_generation_tokens_total"] == before["blendkv_generation_tokens_total"] + 7
    assert after["blendkv_prompt_tokens_total"] > before["blendkv_prompt_tokens_total"]
    for hist in ("blendkv_time_to_first_token_seconds", "blendkv_e2e_request_latency_seconds"):
        assert after[f"{hist}_count"] == before[f"{hist}_count"] + 2
    assert after["blendkv_blend_requests_total"] == before["blendkv_blend_requests_total"] + 1
    chunks = lambda m: m["blendkv_blend_chunks_hit_total"] + m["blendkv_blend_chunks_missed_total"]  # noqa: E731
    assert chunks(after) == chunks(before) + 2
    # the chat passed no blend config: the default target, uncalibrated here, at ratio 0.3
    assert after["blendkv_fidelity_target_recompute_ratio{target=1}"] == UNCALIBRATED_RATIO
    assert after["blendkv_blend_chunks_on_device_total"] == 0  # (no device tier)
    assert after["blendkv_blend_tokens_reused_total"] > before["blendkv_blend_tokens_reused_total"]
    assert after["blendkv_engine_steps_total"] > before["blendkv_engine_steps_total"]
    assert after["blendkv_kv_blocks_used"] == 0 < after["blendkv_kv_blocks_total"]
    assert after["blendkv_num_requests_running"] == after["blendkv_num_requests_waiting"] == 0


def test_langchain_chat_openai_talks_to_the_server(server, client):
    from langchain_openai import ChatOpenAI

    docs = {"documents": [{"text": d} for d in DOCS]}
    for extra_body in (None, docs):  # plain chat, then documents blended through extra_body
        chat = ChatOpenAI(
            base_url=f"{server}/v1",
            api_key=API_KEY,
            model=MODEL,
            temperature=0,
            max_tokens=8,
            max_retries=0,
            timeout=60,
            extra_body=extra_body,
        )
        msg = chat.invoke("Which city is the capital of France?")
        ref = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Which city is the capital of France?"}],
            max_tokens=8,
            temperature=0,
            extra_body=extra_body,
        )
        assert msg.content == ref.choices[0].message.content
        assert (getattr(ref, "blendkv", None) is not None) == (extra_body is not None)


# ---------------------------------------------------------------------------- n choices
def test_n_choices_equal_offline_samples_and_usage_counts_them_all(server, client, offline):
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=10, ignore_eos=True)
    ref = offline.generate(prompt, params)[0]
    assert len({c.text for c in ref.outputs}) > 1, "distinct samples, or the test proves little"
    kw = dict(model=MODEL, prompt=prompt, n=3, max_tokens=10, temperature=1.0, seed=5)
    before = scrape(server, API_KEY)["blendkv_generation_tokens_total"]
    resp = client.completions.create(**kw, extra_body=NO_EOS)
    after = scrape(server, API_KEY)["blendkv_generation_tokens_total"]
    assert after == before + 3 * 10  # every choice's tokens
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [c.text for c in ref.outputs]
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)  # counted once
    assert resp.usage.completion_tokens == 3 * 10
    chunks = list(
        client.completions.create(
            **kw, extra_body=NO_EOS, stream=True, stream_options={"include_usage": True}
        )
    )
    texts, reasons = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons.setdefault(c.index, []).append(c.finish_reason)
    assert texts == {c.index: c.text for c in ref.outputs}
    assert reasons == {i: ["length"] for i in range(3)}
    assert chunks[-1].usage.completion_tokens == 3 * 10


def test_streamed_chat_n_choices_end_one_by_one(client, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=11, n=3)
    free = client.chat.completions.create(**kw)
    text = free.choices[1].message.content
    stop = text[3:5]  # choice 1 stops early; the others where they meet it, if they do
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=12, stop=[stop])
    ref = offline.chat(messages, params)[0]
    full = client.chat.completions.create(**kw, stop=[stop])
    assert [c.message.content for c in full.choices] == [c.text for c in ref.outputs]
    assert [c.finish_reason for c in full.choices] == [c.finish_reason for c in ref.outputs]
    assert full.choices[1].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kw, stop=[stop], stream=True))
    assert [(c.index, c.delta.role) for c in chunks[0].choices] == [
        (i, "assistant") for i in range(3)
    ]
    texts, reasons = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                reasons.setdefault(c.index, []).append(c.finish_reason)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert reasons == {c.index: [c.finish_reason] for c in full.choices}
