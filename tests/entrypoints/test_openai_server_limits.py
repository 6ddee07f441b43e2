"""Server states and limits: 503 while the model loads, 429 (with Retry-After) when more than
``max_waiting`` requests wait for the one batch slot."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import QuietLLM
from server_helpers import open_stream, raw_request, running_server, scrape, wait_for

from blendkv import LLM
from blendkv.entrypoints.openai.api_server import ServeConfig, create_app

pytestmark = pytest.mark.timeout(300)

ENGINE = dict(dtype="float32", block_size=4, max_model_len=256, max_num_seqs=1)
COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def loading_server(tiny_llama_dir):
    """(base URL, what the routes answered while the model was still loading)."""
    gate = threading.Event()

    def load() -> LLM:
        assert gate.wait(timeout=120)
        return QuietLLM(str(tiny_llama_dir), **ENGINE)

    app = create_app(load, ServeConfig(max_waiting=1))
    with running_server(app, load_timeout=None) as url:
        while_loading = {
            "health": raw_request(url, "GET", "/health"),
            "models": raw_request(url, "GET", "/v1/models"),
            "completions": raw_request(url, "POST", "/v1/completions", COMPLETION),
        }
        gate.set()
        assert app.state.blendkv.wait_loaded(timeout=120)
        yield url, while_loading


def test_routes_answer_503_while_loading_then_serve(loading_server):
    url, while_loading = loading_server
    for status, headers, body in while_loading.values():
        assert status == 503
        assert body["error"]["code"] == "model_loading" and "Retry-After" in {
            k.title() for k in headers
        }
    assert raw_request(url, "GET", "/health")[0] == 200
    status, _, body = raw_request(url, "POST", "/v1/completions", COMPLETION)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


def test_429_when_too_many_wait_for_the_batch(loading_server):
    url, _ = loading_server
    # The only batch slot (max_num_seqs=1) is taken by a long stream.
    conn, resp = open_stream(url, 240)
    assert resp.readline().startswith(b"data: ")
    with ThreadPoolExecutor(1) as pool:
        # One request waits for the slot (max_waiting=1) ...
        waiting = pool.submit(raw_request, url, "POST", "/v1/completions", COMPLETION)
        assert wait_for(lambda: scrape(url)["blendkv_num_requests_waiting"] == 1, timeout=30)
        # ... so the next one is refused at once.
        status, headers, body = raw_request(url, "POST", "/v1/completions", COMPLETION)
        assert status == 429, body
        assert body["error"]["type"] == "rate_limit_error" and int(headers["retry-after"]) >= 1
        resp.close()
        conn.close()  # the stream's client leaves: its request is aborted, the slot frees
        status, _, body = waiting.result(timeout=60)
        assert status == 200 and body["choices"][0]["text"] is not None
    assert raw_request(url, "POST", "/v1/completions", COMPLETION)[0] == 200
    assert scrape(url)["blendkv_kv_blocks_used"] == 0
