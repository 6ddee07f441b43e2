"""A real redis-server on a free loopback port, for the shared-store tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``start()``/``kill()``/``start()`` again on the same port (a restarted server, empty)."""

    def __init__(self, tmp_dir, maxmemory: str | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            message = "redis-server is not installed (apt-get install redis-server)"
            if os.environ.get("CI"):
                pytest.fail(message)  # .ci/run installs it: its absence in CI is a failure
            pytest.skip(message)
        self.exe, self.dir, self.maxmemory = exe, str(tmp_dir), maxmemory
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", self.dir]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        for _ in range(100):  # at most ~10 s
            try:
                client.ping()
                client.close()
                return self
            except redis.ConnectionError:
                time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def flush(self) -> None:
        import redis

        redis.Redis(port=self.port).flushall()
