"""Background writes of chunk K/V: the engine step hands chunks over and never waits on a disk.

A chunk computed at query time (a store miss) is submitted here; one thread takes what is
queued, up to ``max_batch`` chunks, and writes it with one ``put_many`` (one LMDB transaction,
one fsync). Until a chunk is written, :meth:`BackgroundWriter.pending` serves it from memory, so
a second request for it neither recomputes it nor waits.

A crash loses at most the chunks not yet written (they are recomputed next time); each batch is
one transaction, so the store itself stays consistent. A failed write is logged and counted, the
chunks are dropped from the pending set, and the engine goes on serving.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections.abc import Sequence

import torch

from .records import NewChunk

logger = logging.getLogger(__name__)

_STOP = object()


class BackgroundWriter:
    def __init__(self, store, max_batch: int = 16) -> None:
        """``store``: anything with ``put_many(list[NewChunk])`` that is safe to call from a
        second thread (:class:`~blendkv.store.KVStore` is)."""
        self.store = store
        self.max_batch = max_batch
        self.num_written = 0
        self.num_failed = 0
        self._queue: queue.Queue = queue.Queue()
        self._pending: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="blendkv-kv-writer", daemon=True)
        self._thread.start()
        # A script that never closes its engine still gets its chunks written at exit.
        atexit.register(self.close)

    def submit(self, chunks: Sequence[NewChunk]) -> None:
        """Queue chunks for writing; returns at once."""
        if not self._thread.is_alive():
            raise RuntimeError("the background writer is closed")
        with self._lock:
            for chunk in chunks:
                self._pending[chunk.key] = chunk.kv
        for chunk in chunks:
            self._queue.put(chunk)

    def pending(self, key: bytes) -> torch.Tensor | None:
        """The K/V of a submitted chunk not written yet, else None (read-only)."""
        with self._lock:
            return self._pending.get(key)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self) -> None:
        """Block until everything submitted so far is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        """Flush, then stop the thread. Idempotent."""
        atexit.unregister(self.close)
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    # ---- the writer thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            batch = [item]
            stop = False
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                batch.append(more)
            self._write(batch)
            for _ in range(len(batch) + stop):
                self._queue.task_done()
            if stop:
                return

    def _write(self, batch: list[NewChunk]) -> None:
        try:
            self.store.put_many(batch)
            self.num_written += len(batch)
        except Exception as exc:  # a full, read-only or closed store must not stop serving
            self.num_failed += len(batch)
            logger.warning("could not write %d chunk(s) of K/V to the store: %s", len(batch), exc)
        finally:
            with self._lock:
                for chunk in batch:
                    self._pending.pop(chunk.key, None)
