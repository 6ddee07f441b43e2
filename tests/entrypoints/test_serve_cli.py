"""``blendkv serve`` as a user runs it: a subprocess on a loopback port, the key from
``BLENDKV_API_KEY``, Ctrl-C to stop (status 130, as for every command); bad options and a
model that fails to load exit 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from helpers import QUIET_FLAGS
from server_helpers import raw_request, wait_for

from blendkv.cli import main

pytestmark = pytest.mark.timeout(180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "blendkv.cli", "serve", "--log-level", "warning", *args]
    if "--model" in args:
        cmd += QUIET_FLAGS
    return subprocess.Popen(
        cmd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # SIGINT acts as in a terminal even where the tests run as a background job (which
        # inherits SIGINT ignored): the Ctrl-C test below sends it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_serve_command_end_to_end(tiny_llama_dir):
    port = free_port()
    proc = serve("--model", str(tiny_llama_dir), "--port", str(port), env={"BLENDKV_API_KEY": "k"})
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert proc.poll() is None, proc.communicate()[1].decode()
            try:
                return raw_request(url, "GET", "/health", timeout=5)[0] == 200
            except OSError:  # not listening yet
                return False

        assert wait_for(healthy, timeout=120, interval=0.2)
        assert raw_request(url, "GET", "/v1/models")[0] == 401
        status, _, body = raw_request(url, "GET", "/v1/models", api_key="k")
        assert status == 200 and body["data"][0]["id"] == tiny_llama_dir.name
        status, _, body = raw_request(
            url, "POST", "/v1/completions", {"prompt": "fox", "max_tokens": 3}, api_key="k"
        )
        assert status == 200 and body["usage"]["completion_tokens"] <= 3
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    # uvicorn shuts down gracefully, then re-raises the signal: Ctrl-C's usual status.
    assert proc.returncode == 130 and "Traceback" not in err.decode(), err.decode()


def test_a_model_that_fails_to_load_exits_2(tmp_path):
    proc = serve("--model", str(tmp_path / "no-such-model"), "--port", str(free_port()))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "blendkv: error:" in err.decode() and "no-such-model" in err.decode()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_device_is_refused_before_serving(capsys):
    assert main(["serve", "--device", "cuda", "--port", "1"]) == 2
    assert "device" in capsys.readouterr().err
