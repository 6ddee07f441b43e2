"""Reading queued requests' chunks ahead of their step (asynchronous loading).

While a blended request waits in the queue, :class:`ChunkPrefetcher`'s thread reads its chunk
keys in arrival order, so the reads leave the step that prefills it. ``hold=False`` (LMDB on the
CPU) only faults the value into the page cache and checks it; ``hold=True`` (Redis; LMDB on
CUDA) reads it as stored (encoded, for an ``int8`` / ``int4`` store) and holds it, within
``max_bytes``, until its step loads it or the request ends.
A key is read once; a step takes (:meth:`take`) what the thread has not started on and reads it
itself. Failures are logged and left to the loader.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from blendkv.store.codecs import kv_nbytes

if TYPE_CHECKING:
    from blendkv.store.base import ChunkKVStore

logger = logging.getLogger(__name__)

_QUEUED, _READING, _DONE = "queued", "reading", "done"


@dataclass
class Prefetched:
    """What :meth:`ChunkPrefetcher.take` hands the loader: the held K/V (None when the value was
    only warmed in the page cache, or was not found) and the seconds its read took."""

    kv: Any
    seconds: float


@dataclass
class _Entry:
    status: str = _QUEUED
    read: bool = False  # False: withdrawn before the thread started on it
    requests: set[str] = field(default_factory=set)
    kv: Any = None
    nbytes: int = 0
    seconds: float = 0.0


class ChunkPrefetcher:
    def __init__(self, store: ChunkKVStore, *, hold: bool, max_bytes: int) -> None:
        """``store``: the manager's chunk store (``warm`` when ``hold`` is False, else
        ``get_encoded``);
        ``max_bytes``: the most held K/V at once (``hold`` only)."""
        self.store = store
        self.hold = hold
        self.max_bytes = max_bytes
        self.num_read = 0
        self.num_failed = 0
        self._cond = threading.Condition()
        self._queue: deque[bytes] = deque()
        self._entries: dict[bytes, _Entry] = {}
        self._keys: dict[str, list[bytes]] = {}  # request -> its keys
        self._outstanding: dict[str, int] = {}  # request -> its keys not done
        self._held_bytes = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="blendkv-kv-prefetch", daemon=True)
        self._thread.start()

    # ---- the engine's side ------------------------------------------------------------------
    def submit(self, request_id: str, keys: list[bytes]) -> None:
        """Queue the reads of a newly queued request's chunks."""
        with self._cond:
            if self._closed or request_id in self._keys:
                return
            keys = list(dict.fromkeys(keys))
            self._keys[request_id] = keys
            waiting = 0
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry()
                    self._queue.append(key)
                entry.requests.add(request_id)
                waiting += entry.status != _DONE
            self._outstanding[request_id] = waiting
            self._cond.notify_all()

    def ready(self, request_id: str) -> bool:
        """Whether every read of the request's chunks is done (True for unknown requests)."""
        with self._cond:
            return self._outstanding.get(request_id, 0) == 0

    def take(self, key: bytes) -> Prefetched | None:
        """The prefetched read of ``key``, or None. Held values: one not started is withdrawn
        (the caller reads it), one under way is waited for (reading it again would fetch it
        twice). Page-cache warm-ups are never waited for, and one not started is withdrawn only
        while other requests' keys wait in the queue: else the thread goes on beside the
        caller's own reads of the same pages (the kernel reads each page once), sharing them."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if not self.hold:
                if entry.status == _QUEUED and self._others_queued(entry):
                    self._finish(entry)  # the thread has other requests' pages to warm
                    return None
                # else it goes on beside the caller's reads of the same pages
                return Prefetched(None, entry.seconds) if entry.read else None
            if entry.status == _QUEUED:
                self._finish(entry)
                return None
            while entry.status == _READING:
                self._cond.wait()
            return Prefetched(entry.kv, entry.seconds) if entry.read else None

    def release(self, request_id: str) -> None:
        """The request's step loaded its chunks, or it ended: drop what is held for it alone."""
        with self._cond:
            self._outstanding.pop(request_id, None)
            for key in self._keys.pop(request_id, ()):
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry.requests.discard(request_id)
                if not entry.requests and entry.status != _READING:
                    del self._entries[key]  # a queued key is skipped by the thread
                    self._held_bytes -= entry.nbytes
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        with self._cond:
            self._entries.clear()
            self._keys.clear()
            self._outstanding.clear()
            self._held_bytes = 0

    # ---- the thread ---------------------------------------------------------------------
    def _next(self) -> tuple[bytes, _Entry] | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                room = not self.hold or self._held_bytes < self.max_bytes
                while room and self._queue:
                    key = self._queue.popleft()
                    entry = self._entries.get(key)
                    if entry is not None and entry.status == _QUEUED:
                        entry.status = _READING
                        return key, entry
                self._cond.wait()

    def _run(self) -> None:
        while (job := self._next()) is not None:
            key, entry = job
            t0 = time.perf_counter()
            kv, ok = None, False
            try:
                if self.hold:
                    kv = self.store.get_encoded(key)
                else:
                    self.store.warm(key)
                ok = True
                self.num_read += 1
            except Exception:  # noqa: BLE001  (the loader reads it again and reports)
                self.num_failed += 1
                logger.warning("prefetching chunk %s failed", key.hex(), exc_info=True)
            with self._cond:
                entry.seconds = time.perf_counter() - t0
                entry.read = ok
                if kv is not None:
                    entry.kv = kv
                    entry.nbytes = kv_nbytes(kv)
                    self._held_bytes += entry.nbytes
                self._finish(entry)
                if not entry.requests:  # released while it was read
                    self._entries.pop(key, None)
                    self._held_bytes -= entry.nbytes

    def _others_queued(self, entry: _Entry) -> bool:
        """Whether keys of requests other than ``entry``'s wait in the queue (lock held)."""
        for key in self._queue:
            other = self._entries.get(key)
            if other is not None and other.status == _QUEUED and other.requests - entry.requests:
                return True
        return False

    def _finish(self, entry: _Entry) -> None:
        """Mark ``entry`` done (lock held) and wake who waits for it."""
        entry.status = _DONE
        for request_id in entry.requests:
            if request_id in self._outstanding:
                self._outstanding[request_id] -= 1
        self._cond.notify_all()
