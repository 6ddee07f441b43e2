"""A real local Redis Cluster: 3 masters + 3 replicas on free loopback ports, in a temp dir.

Built with ``redis-server --cluster-enabled yes`` and ``redis-cli --cluster create ...
--cluster-replicas 1``. ``cluster-node-timeout`` is short so a killed master's replica is
promoted within seconds, and ``cluster-require-full-coverage no`` keeps the other slots served
meanwhile (what docs/guide/redis.md recommends).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest


def _free_ports(n: int) -> list[int]:
    """``n`` ports whose cluster bus ports (+10000) are free too, and no one's port another's
    bus port (44123 and 54123 once were: one node could not start, and the cluster failed)."""
    ports: list[int] = []
    taken: set[int] = set()
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 55000 or port in taken or port + 10000 in taken:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
        taken.update((port, port + 10000))
    return ports


class RedisCluster:
    """``start()`` builds the cluster; ``kill_master_of(key)``; ``stop()`` tears it down."""

    def __init__(self, tmp_dir, masters: int = 3, replicas: int = 1) -> None:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if exe is None or cli is None:
            message = "redis-server/redis-cli are not installed (apt-get install redis-server)"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        self.exe, self.cli, self.dir = exe, cli, str(tmp_dir)
        self.ports = _free_ports(masters * (1 + replicas))
        self.replicas = replicas
        self.procs: dict[int, subprocess.Popen] = {}
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> RedisCluster:
        for port in self.ports:
            node_dir = os.path.join(self.dir, str(port))
            os.makedirs(node_dir, exist_ok=True)
            args = [self.exe, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            args += ["--appendonly", "no", "--dir", node_dir, "--cluster-enabled", "yes"]
            args += ["--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000"]
            args += ["--cluster-require-full-coverage", "no"]
            args += ["--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0"]
            self.procs[port] = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        try:  # a cluster that fails to form leaves no server behind
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self) -> None:
        for port in self.ports:
            self._wait_up(port)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        create = [self.cli, "--cluster", "create", *nodes, "--cluster-replicas"]
        create += [str(self.replicas), "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(create)} failed:\n{done.stdout[-2000:]}{done.stderr}")
        self.wait_ok()

    def _wait_up(self, port: int, timeout: float = 30.0) -> None:
        """Until the node on ``port`` answers PING; raises if it exited or stays silent."""
        import redis

        client = redis.Redis(port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.procs[port].poll() is not None:
                        raise RuntimeError(f"redis-server on port {port} exited") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on {port}: silent {timeout} s") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Until every live node says ``cluster_state:ok`` and sees every slot covered, and
        every replica is in sync with its master."""
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = True
            for port in self.procs:
                try:
                    info = redis.Redis(port=port, socket_timeout=1).cluster("info")
                except redis.RedisError:
                    ok = False
                    break
                if info.get("cluster_state") != "ok" or int(info["cluster_slots_ok"]) != 16384:
                    ok = False
                    break
                replication = redis.Redis(port=port, socket_timeout=1).info("replication")
                if replication["role"] == "slave" and replication["master_link_status"] != "up":
                    ok = False  # a replica not yet in sync could not be promoted
                    break
            if ok:
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")

    def master_port_of(self, key: str) -> int:
        import redis
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        for start, end, master, *_ in redis.Redis(port=next(iter(self.procs))).execute_command(
            "CLUSTER", "SLOTS"
        ):
            if start <= slot <= end:
                return int(master[1])
        raise AssertionError(f"slot {slot} is not covered")

    def replica_of(self, master_port: int) -> int:
        """The port of a live replica of the master on ``master_port``."""
        import redis

        for port in self.procs:
            info = redis.Redis(port=port).info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == master_port:
                return port
        raise AssertionError(f"no replica of {master_port}")

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)

    def flush(self) -> None:
        import redis

        for port in self.procs:
            client = redis.Redis(port=port)
            if client.info("replication")["role"] == "master":
                client.flushall()
