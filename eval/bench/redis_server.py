"""A private redis-server for the benchmarks that compare the Redis store (``blendkv bench store
--backend redis``, ``blendkv bench prefetch --store redis``)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path


def start_redis(root: Path) -> tuple[subprocess.Popen, str]:
    """Start ``redis-server`` from PATH on a free port, persisting nothing, its files in
    ``root``: (process, ``redis://`` URL), once it answers a ping. The caller kills it."""
    import socket

    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found: apt-get install redis-server, or --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(root),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("redis-server did not start")
