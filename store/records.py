"""Plain result types of the store: chunk K/V, chunk metadata, stats and verify reports."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class ChunkKV:
    """K (pre-RoPE) and V of one chunk for all layers.

    Attributes:
        key: the chunk's store key (:func:`~blendkv.store.chunk_key`).
        kv: shape ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``; index 0 of dim 1
            is K, index 1 is V.
    """

    key: bytes
    kv: torch.Tensor

    @property
    def k(self) -> torch.Tensor:
        """K of every layer: ``[num_layers, num_tokens, num_kv_heads, head_dim]``."""
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        """V of every layer: ``[num_layers, num_tokens, num_kv_heads, head_dim]``."""
        return self.kv[:, 1]

    @property
    def num_tokens(self) -> int:
        """The chunk's length in tokens."""
        return self.kv.shape[2]


@dataclass(frozen=True)
class NewChunk:
    """One chunk to write: its key, its K/V tensor and the metadata kept beside it.

    Attributes:
        key: the chunk's store key (:func:`~blendkv.store.chunk_key`).
        kv: its K/V, ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` in the model's
            dtype (the store encodes it with its codec).
        text: the chunk's text (indexed for retrieval when ``doc_id`` is set).
        token_ids: the token ids its K/V was computed from.
        doc_id: the document that owns it; None for K/V cached at query time (evictable,
            never retrieved).
        position: its index within its document.
    """

    key: bytes
    kv: torch.Tensor
    text: str = ""
    token_ids: tuple[int, ...] = ()
    doc_id: str | None = None
    position: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.doc_id is not None and "\x00" in self.doc_id:
            raise ValueError("doc_id must not contain NUL")


@dataclass(frozen=True)
class ChunkMeta:
    """Metadata of a stored chunk, kept as JSON beside its value.

    Attributes:
        chunk_id: the chunk's id in the store (what the index holds).
        key: its store key.
        text: its text.
        token_ids: the token ids its K/V was computed from.
        doc_id: the document that owns it; None for K/V cached at query time.
        position: its index within its source document.
        num_tokens: its length in tokens.
        nbytes: the bytes of its stored value.
        dtype: the dtype of its K/V (e.g. "float32").
        shape: the shape of its K/V tensor.
        created: when it was stored (Unix seconds).
        last_used: when it was last read (Unix seconds; LRU order); 0.0 when not known.
    """

    chunk_id: int
    key: bytes
    text: str
    token_ids: tuple[int, ...]
    doc_id: str | None
    position: int
    num_tokens: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    created: float
    last_used: float = 0.0

    @classmethod
    def for_new(cls, chunk: NewChunk, chunk_id: int, nbytes: int, created: float) -> ChunkMeta:
        """The metadata of ``chunk`` about to be stored as a value of ``nbytes`` bytes."""
        kv = chunk.kv
        return cls(
            chunk_id=chunk_id,
            key=chunk.key,
            text=chunk.text,
            token_ids=tuple(chunk.token_ids),
            doc_id=chunk.doc_id,
            position=chunk.position,
            num_tokens=kv.shape[2],
            nbytes=nbytes,
            dtype=str(kv.dtype).removeprefix("torch."),
            shape=tuple(kv.shape),
            created=created,
        )

    def to_json(self) -> bytes:
        """The JSON the store keeps (``last_used`` is kept apart)."""
        d = {
            "chunk_id": self.chunk_id,
            "key": self.key.hex(),
            "text": self.text,
            "token_ids": list(self.token_ids),
            "doc_id": self.doc_id,
            "position": self.position,
            "num_tokens": self.num_tokens,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "created": self.created,
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview, last_used: float = 0.0) -> ChunkMeta:
        """The metadata :meth:`to_json` wrote."""
        d = json.loads(bytes(raw))
        return cls(
            chunk_id=int(d["chunk_id"]),
            key=bytes.fromhex(d["key"]),
            text=d["text"],
            token_ids=tuple(d["token_ids"]),
            doc_id=d["doc_id"],
            position=int(d["position"]),
            num_tokens=int(d["num_tokens"]),
            nbytes=int(d["nbytes"]),
            dtype=d["dtype"],
            shape=tuple(d["shape"]),
            created=float(d["created"]),
            last_used=last_used,
        )


class PutResult(NamedTuple):
    """Outcome of writing one chunk.

    Attributes:
        chunk_id: the chunk's id in the store.
        inserted: False when the key was already stored (content-addressed: nothing
            rewritten).
        evicted: the chunk ids the write pushed out (LRU).
    """

    chunk_id: int
    inserted: bool
    evicted: tuple[int, ...]


@dataclass(frozen=True)
class StoreStats:
    """Counters of one store. Entries, bytes and evictions are store-wide (persisted);
    hits/misses/corrupt and the memory-tier numbers count this process only.

    Attributes:
        entries: chunks stored.
        bytes: bytes of their values.
        max_bytes: the store's byte limit; None: none (always None for Redis).
        map_size: LMDB's map size in bytes (it grows when full); 0 for Redis.
        map_used: bytes of the map in use (Redis: the server's ``used_memory``).
        evictions: chunks evicted to stay within ``max_bytes`` (Redis: the server's evicted
            keys).
        hits: reads that found their chunk.
        misses: reads that did not (absent or corrupt).
        corrupt: values that failed their checks.
        memory_hits: reads served by the memory tier.
        memory_misses: memory-tier lookups that missed.
        memory_evictions: values the memory tier dropped (LRU).
        memory_entries: values in the memory tier now.
        memory_bytes: their bytes.
        lmdb_hits: reads served from LMDB (0 for Redis).
        lmdb_misses: LMDB reads that missed (0 for Redis).
    """

    entries: int
    bytes: int
    max_bytes: int | None
    map_size: int
    map_used: int
    evictions: int
    hits: int
    misses: int
    corrupt: int
    memory_hits: int
    memory_misses: int
    memory_evictions: int
    memory_entries: int
    memory_bytes: int
    lmdb_hits: int
    lmdb_misses: int


class VerifyProblem(NamedTuple):
    kind: str  # e.g. "corrupt_value", "missing_value", "id_mismatch", "bytes_mismatch"
    subject: str  # key hex, chunk id or db name
    detail: str


@dataclass
class VerifyReport:
    """What :meth:`KVStore.verify` found; ``str(report)`` lists it.

    Attributes:
        entries: chunks checked.
        bytes: bytes of their values.
        problems: ``(kind, subject, detail)`` for each problem found (kind e.g.
            "corrupt_value", "missing_value", "id_mismatch"; subject a key, chunk id or
            database).
    """

    entries: int = 0
    bytes: int = 0
    problems: list[VerifyProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def add(self, kind: str, subject: object, detail: str) -> None:
        """Record a problem."""
        self.problems.append(VerifyProblem(kind, str(subject), detail))

    def __str__(self) -> str:
        head = f"{self.entries} entries, {self.bytes} bytes: "
        if self.ok:
            return head + "OK"
        lines = [f"  {p.kind} {p.subject}: {p.detail}" for p in self.problems]
        return head + f"{len(self.problems)} problem(s)\n" + "\n".join(lines)
