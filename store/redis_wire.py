"""Reading chunk values from Redis straight into one buffer (RESP over a plain socket).

redis-py builds each reply as new ``bytes`` that must then be joined (two copies, many small
Python calls: docs/benchmarks.md). :class:`BulkReader` pipelines the ``GET`` of every part of a
value (its size known from its metadata) and ``recv_into``s each part at its offset in one
``bytearray``: one copy. One connection per thread, so the engine and the prefetch thread read
without a lock. Only ``GET`` replies are parsed; a read that failed on an old connection is
retried once on a new one, then raised as redis-py's ``ConnectionError``/``TimeoutError``. No
TLS: for ``rediss://`` :func:`bulk_reader_for` returns None and reads go through redis-py.

On a Redis Cluster the parts of a value share one hash tag (one slot, one node): a read goes to
the node the slot map names, over a connection per (thread, node). ``-MOVED`` refreshes the
slot map (redis-py's ``CLUSTER SLOTS``) and retries on the named node; ``-ASK`` retries there
with ``ASKING`` before each ``GET``; a lost node marks the map stale (re-read on the next read).
"""

from __future__ import annotations

import socket
import threading

_CHUNK = 1 << 16


class BulkReader:
    def __init__(self, kwargs: dict, timeout: float, cluster=None) -> None:
        """``kwargs``: a redis-py pool's ``connection_kwargs`` (host/port or path, db,
        username, password); ``cluster``: a ``redis.cluster.RedisCluster`` whose slot map
        routes each read (then host/port come from the map)."""
        self._kwargs = kwargs
        self._cluster = cluster
        self._stale = False
        self._timeout = timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[_Connection] = set()
        self._closed = False

    def read(self, names: list[str], nbytes: int) -> bytearray | None:
        """The values of ``names`` (the parts of one chunk, in order) joined into one buffer of
        ``nbytes``; None when a part is missing or the sizes do not add up."""
        import redis

        address, asking = self._route(names[0]), False
        for _ in range(_MAX_REDIRECTS):
            try:
                return self._read_at(address, names, nbytes, asking)
            except _Redirect as r:
                if r.kind == "MOVED":
                    self._refresh()
                address, asking = r.address, r.kind == "ASK"
        raise redis.ConnectionError(f"reading {names[0]}: more than {_MAX_REDIRECTS} redirects")

    def _read_at(
        self, address: tuple[str, int] | None, names: list[str], nbytes: int, asking: bool
    ) -> bytearray | None:
        import redis

        conns = self._conns()
        while True:
            conn = conns.get(address)
            fresh = conn is None
            if fresh:
                conn = self._connect(address)
            try:
                return conn.read_joined(names, nbytes, asking)
            except TimeoutError as e:
                self._drop(conn, address)
                raise redis.TimeoutError(f"reading from Redis timed out: {e}") from e
            except (OSError, _ProtocolError) as e:
                self._drop(conn, address)
                if fresh:  # an older connection may have gone stale (a restarted server)
                    raise redis.ConnectionError(f"reading from Redis failed: {e}") from e

    # ---- routing (a cluster's slot map is redis-py's) -------------------------------------
    def _route(self, name: str) -> tuple[str, int] | None:
        """The (host, port) serving ``name``; None for the one server of ``kwargs``."""
        if self._cluster is None:
            return None
        if self._stale:
            self._refresh()
        node = self._cluster.get_node_from_key(name)
        return (node.host, int(node.port))

    def _refresh(self) -> None:
        import redis

        if self._cluster is None:
            return
        with self._lock:
            try:
                self._cluster.nodes_manager.initialize()
                self._stale = False
            except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
                self._stale = True
                raise redis.ConnectionError(f"cannot read the cluster's slot map: {e}") from e

    def _conns(self) -> dict:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        return conns

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for conn in self._open:
                conn.sock.close()
            self._open.clear()

    def _connect(self, address: tuple[str, int] | None) -> _Connection:
        import redis

        kw = self._kwargs
        try:
            if address is not None:
                sock = socket.create_connection(address, timeout=self._timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            elif kw.get("path"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self._timeout)
                sock.connect(kw["path"])
            else:
                server = (kw.get("host", "localhost"), kw.get("port", 6379))
                sock = socket.create_connection(server, timeout=self._timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock)
            if kw.get("password"):
                user = kw.get("username")
                conn.command(["AUTH", user, kw["password"]] if user else ["AUTH", kw["password"]])
            if kw.get("db"):
                conn.command(["SELECT", str(kw["db"])])
        except (OSError, _ProtocolError) as e:
            self._stale = self._cluster is not None  # a node gone: re-read the slot map
            raise redis.ConnectionError(f"cannot connect to Redis for reads: {e}") from e
        with self._lock:
            if self._closed:
                sock.close()
                raise redis.ConnectionError("the store is closed")
            self._open.add(conn)
        self._conns()[address] = conn
        return conn

    def _drop(self, conn: _Connection, address: tuple[str, int] | None) -> None:
        conn.sock.close()
        with self._lock:
            self._open.discard(conn)
            self._stale = self._cluster is not None
        conns = self._conns()
        if conns.get(address) is conn:
            del conns[address]


_MAX_REDIRECTS = 5


class _ProtocolError(Exception):
    pass


class _Redirect(Exception):
    """A ``-MOVED``/``-ASK`` reply: the read is to be sent to ``address``."""

    def __init__(self, kind: str, address: tuple[str, int]) -> None:
        super().__init__(f"{kind} {address[0]}:{address[1]}")
        self.kind, self.address = kind, address


def _redirect_of(line: bytes) -> _Redirect | None:
    """``-MOVED <slot> <host>:<port>`` or ``-ASK ...`` as a :class:`_Redirect`."""
    words = line[1:].decode("utf-8", "replace").split()
    if len(words) == 3 and words[0] in ("MOVED", "ASK"):
        host, _, port = words[2].rpartition(":")
        return _Redirect(words[0], (host or "127.0.0.1", int(port)))
    return None


class _Connection:
    """One socket and the bytes received past the last reply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._pending = bytearray()

    def command(self, args: list[str]) -> None:
        """Send a command whose reply is a status (``+OK``); raise on an error reply."""
        self.sock.sendall(_encode(args))
        line = self._line()
        if not line.startswith(b"+"):
            raise _ProtocolError(line.decode("utf-8", "replace"))

    def read_joined(self, names: list[str], nbytes: int, asking: bool = False) -> bytearray | None:
        """The ``GET`` of every name, pipelined (each after an ``ASKING`` when ``asking``);
        a redirect is raised after every reply was read (the connection stays in step)."""
        gets = (_encode(["GET", n]) for n in names)
        self.sock.sendall(b"".join(_ASKING + g for g in gets) if asking else b"".join(gets))
        out = bytearray(nbytes)
        view = memoryview(out)
        pos, whole = 0, True
        redirect: _Redirect | None = None
        error: bytes | None = None
        for _ in names:  # read every reply, even after a miss: the connection stays in step
            if asking and (line := self._line()) != b"+OK":
                raise _ProtocolError(f"ASKING answered {line[:40]!r}")
            line = self._line()
            if line.startswith(b"-"):
                redirect = redirect or _redirect_of(line)
                error = error or line
                whole = False
                continue
            if not line.startswith(b"$"):
                raise _ProtocolError(f"unexpected reply {line[:40]!r}")
            n = int(line[1:])
            if n < 0:  # nil: the part was evicted
                whole = False
                continue
            if pos + n > nbytes:  # more than the record says: read it and drop it
                whole = False
                self._skip(n)
            else:
                self._exact(view[pos : pos + n])
                pos += n
            if self._take(2) != b"\r\n":
                raise _ProtocolError("a bulk reply did not end in CRLF")
        if redirect is not None:
            raise redirect
        if error is not None:  # e.g. -CLUSTERDOWN, -TRYAGAIN: the read fails (a miss)
            raise _ProtocolError(error.decode("utf-8", "replace"))
        return out if whole and pos == nbytes else None

    # ---- receiving ----------------------------------------------------------------------
    def _recv(self) -> None:
        data = self.sock.recv(_CHUNK)
        if not data:
            raise _ProtocolError("the server closed the connection")
        self._pending += data

    def _line(self) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            self._recv()
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _take(self, n: int) -> bytes:
        while len(self._pending) < n:
            self._recv()
        data = bytes(self._pending[:n])
        del self._pending[:n]
        return data

    def _exact(self, dest: memoryview) -> None:
        """Fill ``dest``: first from what was received already, then straight from the socket."""
        have = min(len(self._pending), len(dest))
        dest[:have] = self._pending[:have]
        del self._pending[:have]
        pos = have
        while pos < len(dest):
            got = self.sock.recv_into(dest[pos:])
            if got == 0:
                raise _ProtocolError("the server closed the connection")
            pos += got

    def _skip(self, n: int) -> None:
        while n > 0:
            if not self._pending:
                self._recv()
            step = min(n, len(self._pending))
            del self._pending[:step]
            n -= step


def _encode(args: list[str]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


_ASKING = _encode(["ASKING"])


def bulk_reader_for(client, timeout: float) -> BulkReader | None:
    """A :class:`BulkReader` on ``client``'s server (or cluster), or None where it does not
    apply (TLS)."""
    import redis
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        pool = client.get_default_node().redis_connection.connection_pool
        if pool.connection_class is not redis.Connection:
            return None
        return BulkReader(dict(pool.connection_kwargs), timeout, cluster=client)
    pool = client.connection_pool
    if pool.connection_class not in (redis.Connection, redis.UnixDomainSocketConnection):
        return None
    return BulkReader(dict(pool.connection_kwargs), timeout)
