"""Reading chunk values from Redis straight into one buffer (RESP over a plain socket).

redis-py builds each reply as new ``bytes`` that must then be joined (two copies, many small
Python calls: docs/benchmarks.md). :class:`BulkReader` pipelines the ``GET`` of every part of a
value (its size known from its metadata) and ``recv_into``s each part at its offset in one
``bytearray``: one copy. One connection per thread, so the engine and the prefetch thread read
without a lock. Only ``GET`` replies are parsed; a read that failed on an old connection is
retried once on a new one, then raised as redis-py's ``ConnectionError``/``TimeoutError``. No
TLS: for ``rediss://`` :func:`bulk_reader_for` returns None and reads go through redis-py.
"""

from __future__ import annotations

import socket
import threading

_CHUNK = 1 << 16


class BulkReader:
    def __init__(self, kwargs: dict, timeout: float) -> None:
        """``kwargs``: a redis-py pool's ``connection_kwargs`` (host/port or path, db,
        username, password)."""
        self._kwargs = kwargs
        self._timeout = timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[_Connection] = set()
        self._closed = False

    def read(self, names: list[str], nbytes: int) -> bytearray | None:
        """The values of ``names`` (the parts of one chunk, in order) joined into one buffer of
        ``nbytes``; None when a part is missing or the sizes do not add up."""
        import redis

        while True:
            conn = getattr(self._local, "conn", None)
            fresh = conn is None
            if fresh:
                conn = self._connect()
            try:
                return conn.read_joined(names, nbytes)
            except TimeoutError as e:
                self._drop(conn)
                raise redis.TimeoutError(f"reading from Redis timed out: {e}") from e
            except (OSError, _ProtocolError) as e:
                self._drop(conn)
                if fresh:  # an older connection may have gone stale (a restarted server)
                    raise redis.ConnectionError(f"reading from Redis failed: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for conn in self._open:
                conn.sock.close()
            self._open.clear()

    def _connect(self) -> _Connection:
        import redis

        kw = self._kwargs
        try:
            if kw.get("path"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self._timeout)
                sock.connect(kw["path"])
            else:
                address = (kw.get("host", "localhost"), kw.get("port", 6379))
                sock = socket.create_connection(address, timeout=self._timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock)
            if kw.get("password"):
                user = kw.get("username")
                conn.command(["AUTH", user, kw["password"]] if user else ["AUTH", kw["password"]])
            if kw.get("db"):
                conn.command(["SELECT", str(kw["db"])])
        except (OSError, _ProtocolError) as e:
            raise redis.ConnectionError(f"cannot connect to Redis for reads: {e}") from e
        with self._lock:
            if self._closed:
                sock.close()
                raise redis.ConnectionError("the store is closed")
            self._open.add(conn)
        self._local.conn = conn
        return conn

    def _drop(self, conn: _Connection) -> None:
        conn.sock.close()
        with self._lock:
            self._open.discard(conn)
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None


class _ProtocolError(Exception):
    pass


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

    def read_joined(self, names: list[str], nbytes: int) -> bytearray | None:
        self.sock.sendall(b"".join(_encode(["GET", n]) for n in names))
        out = bytearray(nbytes)
        view = memoryview(out)
        pos, whole = 0, True
        for _ in names:  # read every reply, even after a miss: the connection stays in step
            line = self._line()
            if line.startswith(b"-"):
                raise _ProtocolError(line.decode("utf-8", "replace"))
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


def bulk_reader_for(client, timeout: float) -> BulkReader | None:
    """A :class:`BulkReader` on ``client``'s server, or None where it does not apply (TLS)."""
    import redis

    pool = client.connection_pool
    if pool.connection_class not in (redis.Connection, redis.UnixDomainSocketConnection):
        return None
    return BulkReader(dict(pool.connection_kwargs), timeout)
