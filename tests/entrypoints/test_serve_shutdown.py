"""``blendkv serve`` under SIGTERM: in-flight requests drain for at most ``--shutdown-timeout``
seconds while ``/health`` and new requests get 503, then the rest are aborted with a final SSE
error event; and a configuration that could never serve refuses to start."""

from __future__ import annotations

import http.client
import json
import signal

import pytest
from helpers import make_tiny_model_dir
from server_helpers import raw_request, wait_for
from test_serve_cli import free_port, serve

from blendkv.cli import main
from blendkv.entrypoints.openai.api_server import ServeConfig

pytestmark = pytest.mark.timeout(240)


def _healthy(proc, url) -> bool:
    assert proc.poll() is None, proc.communicate()[1].decode()
    try:
        return raw_request(url, "GET", "/health", timeout=5)[0] == 200
    except OSError:  # not listening yet
        return False


def _events(resp) -> list[dict | str]:
    """The rest of an SSE stream: each event's JSON (or "[DONE]")."""
    out = []
    for line in resp:
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_sigterm_drains_then_aborts_with_a_final_error_event(tmp_path):
    # A stream far longer than the 2 s drain on any machine (the shared tiny model allows 1,000
    # tokens, which a fast idle machine decodes within the drain: the stream then ends cleanly)
    model = make_tiny_model_dir(tmp_path / "long", max_position_embeddings=16384)
    port = free_port()
    proc = serve(
        "--model",
        str(model),
        "--port",
        str(port),
        "--attention-backend",
        "torch",
        "--shutdown-timeout",
        "2",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _healthy(proc, url), timeout=120, interval=0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"prompt": "fox", "max_tokens": 16000, "stream": True, "ignore_eos": True}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # the request is running
        proc.send_signal(signal.SIGTERM)
        # Draining: /health says 503 (the stream is still running, far from its 1000 tokens).
        draining = lambda: raw_request(url, "GET", "/health", timeout=5)[0] == 503  # noqa: E731
        assert wait_for(draining, timeout=10, interval=0.02)
        status, _, err = raw_request(url, "POST", "/v1/completions", {"prompt": "x"})
        assert status == 503 and err["error"]["code"] == "server_shutting_down"
        events = _events(resp)
        conn.close()
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
        tokens = sum(1 for e in events[:-2] if e["choices"])
        assert 0 < tokens < 16000  # aborted, not run to the end
        _, err_text = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # uvicorn re-raises the signal after its graceful shutdown.
    assert proc.returncode == -signal.SIGTERM and b"Traceback" not in err_text, err_text


def test_sigterm_without_requests_stops_at_once(tiny_llama_dir):
    port = free_port()
    proc = serve(
        "--model", str(tiny_llama_dir), "--port", str(port), "--attention-backend", "torch"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _healthy(proc, url), timeout=120, interval=0.2)
        proc.send_signal(signal.SIGTERM)
        _, err_text = proc.communicate(timeout=20)  # well under the default 30 s drain
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGTERM, err_text


@pytest.mark.parametrize(
    "flags", [("--max-waiting", "0"), ("--max-body-bytes", "10"), ("--shutdown-timeout", "-1")]
)
def test_a_config_that_can_never_serve_refuses_to_start(tiny_llama_dir, capsys, flags):
    assert main(["serve", "--model", str(tiny_llama_dir), "--port", "1", *flags]) == 2
    assert flags[0][2:].replace("-", "_") in capsys.readouterr().err
    with pytest.raises(ValueError):
        ServeConfig(max_waiting=0)
