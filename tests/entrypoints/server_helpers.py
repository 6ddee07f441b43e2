"""Run the real server (uvicorn, in a thread, on a free 127.0.0.1 port) and talk to it with the
standard library, so tests can send what clients must not (malformed JSON, huge bodies)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from helpers import make_tiny_model_dir
from prometheus_client.parser import text_string_to_metric_families

# A minimal real chat template for the tiny model (the embedded model has its own).
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def make_tiny_chat_model_dir(path: Path) -> Path:
    make_tiny_model_dir(path, "llama")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TINY_CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


@contextmanager
def running_server(app, load_timeout: float | None = 120) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields the base URL. ``load_timeout=None`` returns
    as soon as the server listens, without waiting for the model."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        if load_timeout is not None:
            assert app.state.blendkv.wait_loaded(load_timeout), app.state.blendkv.load_error
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def port_of(base_url: str) -> int:
    return int(base_url.rsplit(":", 1)[1])


def raw_request(
    base_url: str,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    api_key: str | None = None,
    timeout: float = 60,
) -> tuple[int, dict[str, str], dict | str]:
    """(status, headers, JSON body or text) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(base_url), timeout=timeout)
    headers = {"content-type": "application/json"}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read().decode()
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    if hdrs.get("content-type", "").startswith("application/json"):
        return resp.status, hdrs, json.loads(data)
    return resp.status, hdrs, data


def scrape(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """``/metrics`` parsed with prometheus_client's parser: sample name{labels} -> value."""
    status, _, text = raw_request(base_url, "GET", "/metrics", api_key=api_key)
    assert status == 200, text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_for(predicate, timeout: float = 30, interval: float = 0.05):
    """Poll ``predicate`` (bounded in time); returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def open_stream(
    base_url: str, max_tokens: int, model: str | None = None, api_key: str | None = None
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Start a streamed completion that ignores EOS; read it line by line, close it any time."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(base_url), timeout=60)
    body = {
        "model": model,
        "prompt": "Count to a thousand:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"content-type": "application/json"}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp
