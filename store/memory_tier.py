"""A bounded in-RAM LRU of hot chunk K/V, in front of LMDB.

Values are content-addressed, so an entry can never be stale in content; it can at most outlive
its LMDB entry (evicted by another process), which is harmless. Thread-safe. A store with a K/V
codec keeps values here encoded (:class:`~blendkv.store.codecs.EncodedKV`) and the budget counts
their encoded bytes, so the same budget holds more chunks. :attr:`MemoryTier.generation` counts
the changes to the set of keys it holds, so that a summary of them (a replica's report to its
router, :mod:`blendkv.entrypoints.ray_serve.routing`) is rebuilt only when it changed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .codecs import EncodedKV, kv_nbytes

StoredKV = torch.Tensor | EncodedKV  # a raw tensor (codec none) or an encoded chunk


class MemoryTier:
    """LRU cache ``key -> value`` (a tensor or an :class:`EncodedKV`) bounded by ``max_bytes``
    of tensor data.

    Values handed in are kept as they are (not copied); callers must treat values returned
    by :meth:`get` as read-only.

    Attributes:
        max_bytes: the budget in bytes of tensor data (0: nothing is kept).
        hits: lookups that found their key.
        misses: lookups that did not.
        evictions: values dropped to stay within ``max_bytes``.
        generation: bumped whenever a key enters or leaves (a replica's tier summary is
            rebuilt only when it moved).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, StoredKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.generation = 0  # bumped whenever a key enters or leaves

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def stats_fields(self) -> dict[str, int]:
        """The ``memory_*`` fields of :class:`~blendkv.store.records.StoreStats`."""
        return {
            "memory_hits": self.hits,
            "memory_misses": self.misses,
            "memory_evictions": self.evictions,
            "memory_entries": len(self),
            "memory_bytes": self.nbytes,
        }

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def keys_at(self) -> tuple[int, list[bytes]]:
        """``(generation, keys)``, read together."""
        with self._lock:
            return self.generation, list(self._entries)

    def get(self, key: bytes) -> StoredKV | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            tensor = self._entries.get(key)
            if tensor is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return tensor

    def put(self, key: bytes, tensor: StoredKV) -> bool:
        """Admit ``tensor``; returns False if it is larger than the whole budget."""
        size = kv_nbytes(tensor)
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= kv_nbytes(old)
            else:
                self.generation += 1
            while self._entries and self._bytes + size > self.max_bytes:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= kv_nbytes(victim)
                self.evictions += 1
                self.generation += 1
            self._entries[key] = tensor
            self._bytes += size
            return True

    def discard(self, key: bytes) -> None:
        """Drop ``key`` if held."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= kv_nbytes(old)
                self.generation += 1

    def clear(self) -> None:
        """Drop every value."""
        with self._lock:
            if self._entries:
                self.generation += 1
            self._entries.clear()
            self._bytes = 0
