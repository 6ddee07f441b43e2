"""Persistent chunk-K/V store over LMDB, with a memory tier in front.

One LMDB environment per store; many processes read while one writes, and every chunk write is
one transaction, so no reader ever sees half an entry. Reads copy at most once (through LMDB's
memory map, :meth:`KVStore.read_into` / :meth:`KVStore.get`); :meth:`KVStore.reader` and
:meth:`KVStore.snapshot` give zero-copy views for a read transaction or an engine step. One
process may not open a store twice (LMDB's locks are per process); a ``KVStore`` may be shared
between threads, serialised by one re-entrant lock.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import lmdb
import torch

from blendkv.sizes import format_size

from . import codecs, opening, txn_ops
from . import format as fmt
from .capacity import store_full_error
from .codecs import EncodedKV, decode_reference
from .errors import CorruptValueError, StoreError, StoreFullError
from .fingerprint import ModelFingerprint
from .locking import locked
from .memory_tier import MemoryTier
from .queries import StoreQueries
from .reader import ReadSnapshot, checked_value
from .records import ChunkKV, ChunkMeta, NewChunk, PutResult
from .transactions import StoreTransactions

logger = logging.getLogger(__name__)


class KVStore(StoreTransactions, StoreQueries):
    """Chunk K/V values plus metadata, content-addressed, LRU-bounded, fingerprint-checked.

    Args:
        path: store directory (created when missing and ``create`` is true).
        fingerprint: the model's fingerprint. ``None`` opens an existing store in *inspect*
            mode: stats, metadata and verify work, K/V is neither served nor written.
        create: create the store if the directory is missing or empty.
        readonly: open without write access (implies ``create=False``).
        max_bytes: capacity in value bytes, saved in the store (``None``: the saved one, if
            any). Past it, the least-recently-used chunks no document owns are evicted, then a
            write raises :class:`StoreFullError`.
        map_size: initial LMDB map size in bytes; it grows automatically when full.
        memory_tier_bytes: budget of the in-RAM LRU of hot chunks (0 disables it).
        verify_reads: payload checksum on reads from LMDB: ``True`` on every read, ``"once"``
            on the first read of each key by this object (values are immutable once written;
            the header is still checked every time), ``False`` never.
        sync: fsync on commit (off trades durability on power loss, not consistency, for speed).
        touch_flush_every: LRU touches from reads are batched and written every this many.

    Attributes:
        max_bytes: the capacity in value bytes in force: the one given, else the saved one
            (None: unbounded).
        memory_tier: the in-RAM LRU of hot chunks.
        fingerprint: the store's model fingerprint.
        inspect_only: opened without a fingerprint: K/V is neither served nor written.
        hits: reads in this process that found their chunk.
        misses: reads that did not (absent or corrupt).
        corrupt: values that failed their checks.
        lmdb_hits: reads served from LMDB rather than the memory tier.
        lmdb_misses: LMDB reads that missed.
        connection_errors: always 0 (a Redis store counts lost connections).
        tier: "lmdb".
        pin_memory: False (values are read in place, not into pinned memory).
        reads_in_place: True: values are viewed in LMDB's memory map (``snapshot``, ``warm``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        fingerprint: ModelFingerprint | None = None,
        *,
        create: bool = True,
        readonly: bool = False,
        max_bytes: int | None = None,
        map_size: int = 1 << 30,
        memory_tier_bytes: int = 256 << 20,
        verify_reads: bool | str = "once",
        sync: bool = True,
        touch_flush_every: int = 256,
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
        self._lock = threading.RLock()
        self.path = Path(path)
        self.readonly = readonly
        self.max_bytes = max_bytes
        if verify_reads not in (True, False, "once"):
            raise ValueError(f"verify_reads must be True, False or 'once', got {verify_reads!r}")
        self.verify_reads = verify_reads
        self._verified: set[bytes] = set()
        self.touch_flush_every = touch_flush_every
        self.memory_tier = MemoryTier(memory_tier_bytes)
        self.hits = self.misses = self.corrupt = 0
        self.connection_errors = 0
        self.lmdb_hits = self.lmdb_misses = 0
        self._pending_touches: OrderedDict[bytes, float] = OrderedDict()
        self._snapshots: list[ReadSnapshot] = []  # open ones; the map may not grow meanwhile
        self._no_snapshots = threading.Condition(self._lock)
        self._deferred_deletes: set[bytes] = set()  # corrupt values seen through a snapshot
        self._env: lmdb.Environment | None = None
        self._reg_key = None
        is_new = opening.check_directory(
            self.path, create=create, readonly=readonly, fingerprint=fingerprint
        )
        self._reg_key = opening.register(self.path)
        try:
            self._env = opening.open_env(self.path, readonly=readonly, map_size=map_size, sync=sync)
            self._dbs = opening.open_dbs(self._env, self.path, create=is_new)
            if is_new:
                self._write(lambda txn, _: opening.initialise(txn, self._dbs, fingerprint))
            with self._read() as txn:
                self.fingerprint = opening.check_format_and_fingerprint(
                    txn, self._dbs, self.path, fingerprint
                )
                saved = opening.read_max_bytes(txn, self._dbs)
            if max_bytes is None:
                self.max_bytes = saved
            elif max_bytes != saved and not readonly:
                self._write(lambda txn, _: opening.write_max_bytes(txn, self._dbs, max_bytes))
        except BaseException:
            self.close()
            raise
        self.inspect_only = fingerprint is None

    @locked
    def close(self) -> None:
        """Close open snapshots, write pending LRU touches, and close LMDB."""
        for snapshot in list(self._snapshots):
            snapshot.close()
        if self._env is not None:
            if not self.readonly and self._pending_touches:
                try:
                    self._write(lambda txn, counters: None)
                except StoreError:
                    logger.warning("could not flush LRU touches of %s", self.path)
            self._env.close()
            self._env = None
        if self._reg_key is not None:
            opening.unregister(self._reg_key)
            self._reg_key = None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- writing ---------------------------------------------------------------------------

    def _check_servable(self) -> None:
        if self.inspect_only:
            raise StoreError(f"store {self.path} was opened without a fingerprint (inspect mode)")

    @property
    def kv_codec(self) -> str:
        """How this store encodes K/V (:mod:`blendkv.store.codecs`); from its fingerprint."""
        return self.fingerprint.kv_codec

    def _check_shape(self, chunk: NewChunk) -> None:
        fp, kv = self.fingerprint, chunk.kv
        want = (fp.num_layers, 2, None, fp.num_kv_heads, fp.head_dim)
        pairs = zip(want, kv.shape, strict=False)
        if len(kv.shape) != 5 or any(w is not None and w != s for w, s in pairs):
            raise ValueError(
                f"chunk K/V shape {tuple(kv.shape)} does not match [num_layers={fp.num_layers}, "
                f"2, num_tokens, num_kv_heads={fp.num_kv_heads}, head_dim={fp.head_dim}]"
            )
        if chunk.token_ids and len(chunk.token_ids) != kv.shape[2]:
            raise ValueError(f"{len(chunk.token_ids)} token ids for {kv.shape[2]} K/V tokens")

    def put(self, key: bytes, kv: torch.Tensor, **meta) -> PutResult:
        """Store one chunk (see :class:`NewChunk` for the metadata keywords)."""
        return self.put_many([NewChunk(key, kv, **meta)])[0]

    @locked
    def put_many(self, chunks: Sequence[NewChunk]) -> list[PutResult]:
        """Store chunks in ONE transaction (all or none). Already-stored keys are only touched.

        Evicts least-recently-used chunks that no document owns (never ones of this batch) past
        ``max_bytes``; raises :class:`StoreFullError` (nothing written) if that is not enough.
        """
        self._check_servable()
        encoded = []
        for chunk in chunks:
            self._check_shape(chunk)
            encoded.append(
                fmt.encode_value(codecs.encode_for_store(self.kv_codec, chunk.kv, self.path))
            )
        new_bytes = sum(len(v) for v in encoded)
        if self.max_bytes is not None and new_bytes > self.max_bytes:
            raise StoreFullError(
                f"store {self.path}: a write of {format_size(new_bytes)} is larger than the "
                f"store's limit of {format_size(self.max_bytes)}; raise the limit "
                "(--store-max-bytes, store_max_bytes=)"
            )
        # Corrupt values a snapshot saw are deleted when it closes: a good copy replaces them
        # now, or that delete would drop it (the lock keeps snapshots from closing meanwhile).
        replace = {c.key for c in chunks} & self._deferred_deletes
        write = functools.partial(self._put_txn, chunks, encoded, replace, time.time())
        results, evicted = self._write(write)
        self._deferred_deletes -= replace
        for key in replace:
            self._verified.discard(key)
        for key, _ in evicted:
            self.memory_tier.discard(key)
            self._verified.discard(key)
        if evicted:
            ids = tuple(cid for _, cid in evicted)
            results = [r._replace(evicted=ids) if i == 0 else r for i, r in enumerate(results)]
        return results

    def _put_txn(self, chunks, encoded, replace: set[bytes], now: float, txn, counters):
        """``put_many``'s transaction: insert new keys, touch stored ones (replace those in
        ``replace``), evict past ``max_bytes``; returns (results, evicted)."""
        results, batch_keys = [], set()
        for chunk, value in zip(chunks, encoded, strict=True):
            batch_keys.add(chunk.key)
            raw = txn.get(chunk.key, db=self._dbs["chunks"])
            if raw is not None and chunk.key in replace:
                txn_ops.delete(txn, self._dbs, counters, chunk.key)
                raw = None
            if raw is not None:
                txn_ops.touch(txn, self._dbs, counters, chunk.key, now)
                results.append(PutResult(ChunkMeta.from_json(raw).chunk_id, False, ()))
                continue
            cid = txn_ops.insert(txn, self._dbs, counters, chunk, value, now)
            results.append(PutResult(cid, True, ()))
        evicted = txn_ops.evict(txn, self._dbs, counters, self.max_bytes, batch_keys)
        if self.max_bytes is not None and counters.total_bytes > self.max_bytes:
            raise store_full_error(self.path, self.max_bytes, counters.total_bytes, encoded)
        return results, evicted

    @locked
    def delete(self, keys: Sequence[bytes]) -> list[int]:
        """Delete chunks by key in one transaction; returns the chunk ids that existed."""
        for key in keys:
            self.memory_tier.discard(key)
            self._verified.discard(key)

        def delete(txn, counters):
            return [txn_ops.delete(txn, self._dbs, counters, bytes(k)) for k in keys]

        found = self._write(delete)
        return [cid for cid in found if cid is not None]

    def delete_document(self, doc_id: str) -> list[int]:
        """Delete every chunk of ``doc_id``; returns their chunk ids."""
        return self.delete([meta.key for meta in self.document_chunks(doc_id)])

    @locked
    def reassign(self, moves: Sequence[tuple[bytes, str, int]]) -> int:
        """Hand stored chunks to another document: ``(key, doc_id, position)`` each, in one
        transaction; returns how many were stored. A chunk shared by two documents is stored
        once, under the first; deleting that one hands the chunk to the other."""

        def reassign(txn, counters):
            return sum(txn_ops.reassign(txn, self._dbs, bytes(k), d, p) for k, d, p in moves)

        return self._write(reassign)

    # ---- reading ---------------------------------------------------------------------------

    def _checked_header(self, txn, key: bytes, buf) -> fmt.ValueHeader | None:
        once = self.verify_reads == "once"
        full = self.verify_reads is True or (once and key not in self._verified)
        try:
            header = fmt.check_value(buf, verify_checksum=full, codec=self.kv_codec)
            if once and full:
                if len(self._verified) > 1_000_000:  # bound the memory: just re-verify later
                    self._verified.clear()
                self._verified.add(key)
            return header
        except CorruptValueError as e:
            self.corrupt += 1
            self.misses += 1
            logger.warning("corrupt value for chunk %s in %s: %s", key.hex(), self.path, e)
            return None

    def _on_corrupt(self, key: bytes) -> None:
        # Drop the entry so that a write-back can store a good copy (a miss is recomputed).
        if not self.readonly:
            self.delete([key])

    tier = "lmdb"
    pin_memory = False
    reads_in_place = True

    def get(self, key: bytes, *, skip_memory_tier: bool = False) -> ChunkKV | None:
        """The chunk's K/V (decoded to the model dtype), or None on a miss or a corrupt value.

        The tensor owns its memory (it is not tied to any LMDB transaction) but may be shared
        with the memory tier (codec ``none``): treat it as read-only.
        """
        value = self.get_encoded(key, skip_memory_tier=skip_memory_tier)
        return None if value is None else ChunkKV(key, decode_reference(value))

    @locked
    def get_encoded(
        self, key: bytes, *, skip_memory_tier: bool = False
    ) -> torch.Tensor | EncodedKV | None:
        """The chunk's value as stored: the raw tensor (codec ``none``) or its
        :class:`EncodedKV` (decode it while loading: nothing here decodes). None on a miss or a
        corrupt value. Owns its memory (pinned with ``pin_memory``), may be shared with the
        memory tier: read-only."""
        self._check_servable()
        use_tier = self.memory_tier.max_bytes and not skip_memory_tier
        value = self.memory_tier.get(key) if use_tier else None
        if value is None:
            value = self._load(key, None)
            if value is None:
                return None
            self.memory_tier.put(key, value)
        self.hits += 1
        self._record_use(key)
        return value

    def warm(self, key: bytes) -> bool:
        """Bring ``key``'s value into the OS page cache ahead of its use, without holding the
        store's lock while the disk reads (:meth:`ReadSnapshot.warm`); False on a miss."""
        snapshot = self.snapshot()
        if snapshot is None:  # the map must be remapped first: leave it to the read
            return False
        try:
            return snapshot.warm(key)
        finally:
            snapshot.close()

    @locked
    def read_into(self, key: bytes, out: torch.Tensor, *, admit: bool = False) -> bool:
        """Copy the chunk's K/V straight from the memory map into ``out`` (any device).

        ``out`` must have the stored shape and dtype. Returns False on a miss or corrupt value
        (``out`` may then hold partial data). ``admit`` also keeps a copy in the memory tier.
        """
        self._check_servable()
        tensor = self.memory_tier.get(key) if self.memory_tier.max_bytes else None
        if tensor is not None:
            if tuple(tensor.shape) != tuple(out.shape) or tensor.dtype != out.dtype:
                raise ValueError(
                    f"out is {out.dtype}{tuple(out.shape)}, stored {tensor.dtype}"
                    f"{tuple(tensor.shape)}"
                )
            out.copy_(decode_reference(tensor))
        else:
            value = self._load(key, out, keep_encoded=admit)
            if value is None:
                return False
            if admit and self.memory_tier.max_bytes:
                if not isinstance(value, EncodedKV):
                    value = out.detach().to("cpu", copy=True)
                self.memory_tier.put(key, value)
        self.hits += 1
        self._record_use(key)
        return True

    def _load(
        self, key: bytes, out: torch.Tensor | None, *, keep_encoded: bool = False
    ) -> torch.Tensor | EncodedKV | None:
        """Read from LMDB into ``out`` (decoded) or, without ``out``, a new tensor (codec
        ``none``) or :class:`EncodedKV` (copied out of the map). With ``out`` and
        ``keep_encoded`` an encoded value is also returned copied. None on miss/corruption."""
        corrupt_before = self.corrupt
        with self._read() as txn:
            found = checked_value(self, txn, key)
            if found is not None and found[1].codec != "none":
                buf, header = found
                value = fmt.decode_value(buf, header)
                if out is not None:
                    fmt.check_out(out, header)
                    out.copy_(decode_reference(value, out.dtype))
                    if not keep_encoded:
                        value = out
                if value is not out:
                    payload = torch.empty(
                        header.nbytes, dtype=torch.uint8, pin_memory=self.pin_memory
                    )
                    payload.copy_(fmt.payload_view(buf))
                    value = fmt.decode_payload(payload, header)
                out = value
            elif found is not None:
                buf, header = found
                if out is None:
                    out = torch.empty(header.shape, dtype=header.dtype, pin_memory=self.pin_memory)
                else:
                    fmt.check_out(out, header)
                src = fmt.payload_view(buf)
                if out.is_contiguous():
                    out.view(-1).view(torch.uint8).copy_(src)
                else:
                    out.copy_(src.view(header.dtype).view(header.shape))
        if found is None:
            if self.corrupt != corrupt_before:
                self._on_corrupt(key)
            return None
        self.lmdb_hits += 1
        return out
