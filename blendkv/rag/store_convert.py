"""Re-encode a whole store with another K/V codec: ``blendkv store convert SRC DST --codec``.

Every chunk of ``SRC`` (LMDB directory or Redis URL) is read decoded and written to the new
store ``DST`` (either backend) under the same key, text, token ids, document and position;
chunk keys do not depend on the codec (:meth:`ModelFingerprint.digest`), so the document
catalog is copied as it is. The embeddings are copied, not recomputed (no embedder model is
loaded): from the source's FAISS index file, or from a Redis source's stored embeddings. DST
is verified at the end (values, index and catalog).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from blendkv.rag import index as index_module
from blendkv.rag.chunk_store import INDEX_FILE
from blendkv.rag.embedding import MiniLMEmbedder
from blendkv.rag.index import ChunkIndex
from blendkv.store.backends import open_kv_store, stored_fingerprint
from blendkv.store.codecs import check_codec
from blendkv.store.errors import StoreError, StoreNotFoundError
from blendkv.store.records import ChunkMeta, NewChunk, VerifyReport
from blendkv.store.redis_store import is_redis_url


@dataclass(frozen=True)
class ConvertResult:
    chunks: int
    src_bytes: int
    dst_bytes: int
    src_codec: str
    dst_codec: str
    report: VerifyReport


def _source_vectors(src, src_index: ChunkIndex | None, metas: list[ChunkMeta]) -> np.ndarray:
    """The stored document chunks' embeddings (float32 rows), in ``metas`` order."""
    if src_index is not None:
        return src_index._vectors(np.array([m.chunk_id for m in metas], dtype=np.int64))
    raws = src.embeddings([m.key for m in metas])
    if any(r is None for r in raws):
        raise StoreError(f"{src.path}: a chunk's embedding is missing; run `blendkv store verify`")
    return np.stack([np.frombuffer(r, dtype=np.float32) for r in raws])


def convert_store(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    codec: str,
    *,
    batch_chunks: int = 32,
    progress: Callable[[int], None] | None = None,
) -> ConvertResult:
    """Write every chunk of store ``src`` into a new store ``dst`` encoded with ``codec``.

    ``progress(n)`` is called after each batch with the number of chunks it wrote.
    Raises :class:`StoreNotFoundError` without a store at ``src``, :class:`StoreError` when
    ``dst`` already holds one.
    """
    from blendkv.rag.catalog import open_catalog
    from blendkv.rag.consistency import check_documents

    check_codec(codec)
    fingerprint = stored_fingerprint(src)
    if fingerprint is None:
        raise StoreNotFoundError(f"no blendkv store at {src}")
    if stored_fingerprint(dst) is not None:
        raise StoreError(f"{dst} already holds a store; convert into a new location")
    source = open_kv_store(src, fingerprint, readonly=True, memory_tier_bytes=0)
    try:
        src_index = None
        if not is_redis_url(src) and (source.path / INDEX_FILE).exists():
            src_index = _load_index(source.path / INDEX_FILE)
        options = {} if is_redis_url(dst) else {"max_bytes": getattr(source, "max_bytes", None)}
        target = open_kv_store(dst, fingerprint.with_codec(codec), memory_tier_bytes=0, **options)
        try:
            index = _copy_chunks(source, target, src_index, batch_chunks, progress)
            if index is not None and not is_redis_url(dst):
                index.save(target.path / INDEX_FILE)
            src_catalog, dst_catalog = open_catalog(src, source), open_catalog(dst, target)
            for doc_id, entry in src_catalog.documents().items():
                dst_catalog.put(
                    doc_id,
                    source=entry.get("source"),
                    metadata=entry.get("metadata", {}),
                    chunk_keys=src_catalog.chunk_keys(doc_id) or [],
                )
            report = target.verify()
            check_documents(dst_catalog, target, report)
            return ConvertResult(
                report.entries,
                source.stats().bytes,
                target.stats().bytes,
                fingerprint.kv_codec,
                codec,
                report,
            )
        finally:
            target.close()
    finally:
        source.close()


def _copy_chunks(source, target, src_index, batch_chunks, progress) -> ChunkIndex | None:
    """Copy the chunks in chunk-id order; returns DST's index (None when no vectors)."""
    metas = sorted(source.iter_meta(), key=lambda m: m.chunk_id)
    index = None
    if src_index is not None:
        index = ChunkIndex(src_index.dim, src_index.embedder_name, src_index.kind)
    for start in range(0, len(metas), batch_chunks):
        batch = metas[start : start + batch_chunks]
        chunks = []
        for meta in batch:
            found = source.get(meta.key)
            if found is None:
                raise StoreError(f"chunk {meta.key.hex()} of {source.path} is missing or corrupt")
            chunks.append(
                NewChunk(meta.key, found.kv, meta.text, meta.token_ids, meta.doc_id, meta.position)
            )
        results = target.put_many(chunks)
        docs = [(m, r.chunk_id) for m, r in zip(batch, results, strict=True) if m.doc_id]
        if docs and (src_index is not None or not source.reads_in_place):
            vectors = _source_vectors(source, src_index, [m for m, _ in docs])
            if not target.reads_in_place:  # a Redis target keeps the embeddings: its index
                target.put_embeddings([m.key for m, _ in docs], vectors)
            else:
                if index is None:  # a Redis source: the CLI's embedder built its index
                    index = ChunkIndex(vectors.shape[1], MiniLMEmbedder.name, "flat")
                index.add([cid for _, cid in docs], vectors)
        if progress is not None:
            progress(len(batch))
    return index


def _load_index(path) -> ChunkIndex:
    """A saved FAISS index, whatever embedder built it (its header names it)."""
    data = path.read_bytes()
    start = len(index_module._MAGIC)
    (hlen,) = struct.unpack_from("<I", data, start)
    header = json.loads(data[start + 4 : start + 4 + hlen])
    return ChunkIndex.load(path, header["embedder"], header["dim"])
