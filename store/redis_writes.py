"""The write path of a :class:`~blendkv.store.redis_store.RedisKVStore`: put, delete, reassign.

A mixin over the store's client, key helpers and ``_call``; the key layout and the
consistency rules (each chunk one ``MULTI``, its metadata marker last; the id and document
sets right after; ``WAIT`` for a replica on a cluster) are in :mod:`.redis_store`'s docstring.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch

from . import codecs
from . import format as fmt
from .errors import StoreError
from .records import ChunkMeta, NewChunk, PutResult


class RedisWrites:
    # ---- writing ------------------------------------------------------------------------
    def put(self, key: bytes, kv: torch.Tensor, **meta) -> PutResult:
        return self.put_many([NewChunk(key, kv, **meta)])[0]

    def put_many(self, chunks: Sequence[NewChunk]) -> list[PutResult]:
        """Store chunks; each chunk is one MULTI (parts, then its metadata marker)."""
        self._check_servable()
        if self.readonly:
            raise StoreError(f"store {self.url} is open read-only")
        return self._call(lambda: [self._put_one(c) for c in chunks], StoreError)

    def _put_one(self, chunk: NewChunk) -> PutResult:
        fp = self.fingerprint
        kv = chunk.kv
        if len(kv.shape) != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != (
            fp.num_layers, 2, fp.num_kv_heads, fp.head_dim,
        ):  # fmt: skip
            raise ValueError(f"chunk K/V shape {tuple(kv.shape)} does not match the store")
        raw = self.client.get(self._chunk(chunk.key, "m"))
        if raw is not None:
            return PutResult(json.loads(raw)["chunk_id"], False, ())
        value = fmt.encode_value(codecs.encode_for_store(self.kv_codec, kv, self.url))
        cid = int(self.client.incr(self._k("next_id")))
        meta = ChunkMeta.for_new(chunk, cid, len(value), time.time())
        record = json.loads(meta.to_json())
        parts = [value[i : i + self.part_bytes] for i in range(0, len(value), self.part_bytes)]
        record["parts"] = len(parts)
        pipe = self.client.pipeline(transaction=True)  # MULTI ... EXEC
        for i, part in enumerate(parts):
            pipe.set(self._chunk(chunk.key, f"p:{i}"), bytes(part))
        pipe.set(self._chunk(chunk.key, "m"), json.dumps(record))  # the marker, last
        pipe.execute()
        self._wait_replica(self._chunk(chunk.key, "m"))
        index = self.client.pipeline(transaction=False)
        index.set(self._k("id", cid), chunk.key.hex())
        index.sadd(self._k("chunks"), chunk.key.hex())
        if chunk.doc_id is not None:
            index.sadd(self._k("doc", chunk.doc_id), chunk.key.hex())
        index.incr(self._k("gen"))
        index.execute()
        self._wait_replica(self._k("gen"))
        return PutResult(cid, True, ())

    def put_embeddings(self, keys: Sequence[bytes], vectors) -> None:
        """Keep chunks' text embeddings (float32 rows) for FAISS rebuilds in other processes."""

        def write():
            pipe = self.client.pipeline(transaction=False)
            for key, vec in zip(keys, vectors, strict=True):
                pipe.set(self._chunk(key, "e"), vec.astype("float32").tobytes())
            pipe.execute()

        self._call(write, StoreError)

    def embeddings(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._call(
            lambda: self._mget([self._chunk(k, "e") for k in keys]),
            StoreError,
        )

    def delete(self, keys: Sequence[bytes]) -> list[int]:
        for key in keys:
            self.memory_tier.discard(key)
        found = self._call(lambda: [self._delete_one(k) for k in keys], StoreError)
        return [cid for cid in found if cid is not None]

    def _delete_one(self, key: bytes) -> int | None:
        raw = self.client.get(self._chunk(key, "m"))
        record = json.loads(raw) if raw is not None else None
        parts = record["parts"] if record else 0
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self._chunk(key, "m"), self._chunk(key, "e"))
        for i in range(parts):
            pipe.delete(self._chunk(key, f"p:{i}"))
        pipe.execute()
        index = self.client.pipeline(transaction=False)
        index.srem(self._k("chunks"), key.hex())
        if record is not None:
            index.delete(self._k("id", record["chunk_id"]))
            if record["doc_id"] is not None:
                index.srem(self._k("doc", record["doc_id"]), key.hex())
        index.incr(self._k("gen"))
        index.execute()
        return record["chunk_id"] if record else None

    def delete_document(self, doc_id: str) -> list[int]:
        return self.delete([m.key for m in self.document_chunks(doc_id)])

    def reassign(self, moves: Sequence[tuple[bytes, str, int]]) -> int:
        """:meth:`KVStore.reassign <blendkv.store.KVStore.reassign>`: each chunk's metadata is
        rewritten, then the document sets follow (as a put)."""
        return sum(self._call(lambda: [self._reassign_one(*m) for m in moves], StoreError))

    def _reassign_one(self, key: bytes, doc_id: str, position: int) -> bool:
        raw = self.client.get(self._chunk(key, "m"))
        if raw is None:
            return False
        record = json.loads(raw)
        old = record["doc_id"]
        record.update(doc_id=doc_id, position=position)
        self.client.set(self._chunk(key, "m"), json.dumps(record))
        index = self.client.pipeline(transaction=False)
        if old is not None:
            index.srem(self._k("doc", old), key.hex())
        index.sadd(self._k("doc", doc_id), key.hex())
        index.incr(self._k("gen"))
        index.execute()
        return True
