"""The document catalog: per-document facts the chunk store does not keep (source file, user
metadata, the keys of its chunks), as one JSON file beside the LMDB files.

The chunk store stays the source of truth for *which* chunks exist; the catalog is written
after the store (and rewritten atomically, via a temporary file and ``os.replace``), so a crash
in between leaves at worst a document whose chunks are stored but which the catalog lacks,
never a half-written catalog. :mod:`blendkv.rag.consistency` finds such documents (``store
verify``) and a re-run of ingest repairs them.

A document's entry lists its chunk keys (hex) because the store cannot say which chunks a
document *uses*: chunks are content-addressed, so a chunk equal to one of another document is
stored once, under the document that wrote it first.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from blendkv.store.redis_store import is_redis_url

CATALOG_FILE = "rag_documents.json"


class DocumentCatalog:
    def __init__(self, store_dir: str | os.PathLike) -> None:
        self.path = Path(store_dir) / CATALOG_FILE
        self._docs: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self._docs = json.loads(self.path.read_text(encoding="utf-8"))

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._docs

    def get(self, doc_id: str | None) -> dict[str, Any]:
        """``{"source", "metadata", "num_chunks", "added"}`` of a document ({} if absent)."""
        entry = self._docs.get(doc_id) if doc_id is not None else None
        return _public(entry) if entry is not None else {}

    def documents(self) -> dict[str, dict[str, Any]]:
        """doc id -> :meth:`get` of every document."""
        return {k: _public(v) for k, v in self._docs.items()}

    def chunk_keys(self, doc_id: str) -> list[bytes] | None:
        """The keys of the document's chunks in order, None if absent or recorded by a version
        that did not keep them."""
        keys = self._docs.get(doc_id, {}).get("chunk_keys")
        return [bytes.fromhex(k) for k in keys] if keys is not None else None

    def key_documents(self) -> dict[bytes, list[str]]:
        """chunk key -> the doc ids whose entries list it, in catalog order (a chunk equal in
        two documents is stored once and listed by both)."""
        out: dict[bytes, list[str]] = {}
        for doc_id, entry in self._docs.items():
            for key in entry.get("chunk_keys") or ():
                docs = out.setdefault(bytes.fromhex(key), [])
                if not docs or docs[-1] != doc_id:
                    docs.append(doc_id)
        return out

    def find(self, ref: str) -> list[str]:
        """The doc ids ``ref`` names: a doc id, else every document whose source is ``ref``
        (a path compares after normalisation: ``./docs/a.md`` names ``docs/a.md``)."""
        docs = self._docs
        if ref in docs:
            return [ref]
        norm = os.path.normpath(ref)
        return [
            d
            for d, entry in docs.items()
            if entry.get("source") is not None
            and (entry["source"] == ref or os.path.normpath(entry["source"]) == norm)
        ]

    def put(
        self, doc_id: str, *, source: str | None, metadata: dict, chunk_keys: list[bytes]
    ) -> None:
        self._docs[doc_id] = {
            "source": source,
            "metadata": metadata,
            "num_chunks": len(chunk_keys),
            "added": time.time(),
            "chunk_keys": [k.hex() for k in chunk_keys],
        }
        self._save()

    def remove(self, doc_id: str) -> bool:
        if self._docs.pop(doc_id, None) is None:
            return False
        self._save()
        return True

    def _save(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".catalog-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self._docs, f, ensure_ascii=False, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class RedisDocumentCatalog(DocumentCatalog):
    """The same catalog in a Redis hash (``{namespace}:catalog``, doc id -> JSON entry, under
    the store-wide hash tag) of a shared store, so every engine process sees the same document
    set. Reads go to Redis."""

    def __init__(self, kv) -> None:
        self._client = kv.client
        self._hash = kv._k("catalog")

    @property
    def _docs(self) -> dict[str, dict[str, Any]]:
        raw = self._client.hgetall(self._hash)
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def __contains__(self, doc_id: str) -> bool:
        return bool(self._client.hexists(self._hash, doc_id))

    def put(self, doc_id, *, source, metadata, chunk_keys) -> None:
        entry = {
            "source": source,
            "metadata": metadata,
            "num_chunks": len(chunk_keys),
            "added": time.time(),
            "chunk_keys": [k.hex() for k in chunk_keys],
        }
        self._client.hset(self._hash, doc_id, json.dumps(entry, ensure_ascii=False))

    def remove(self, doc_id: str) -> bool:
        return bool(self._client.hdel(self._hash, doc_id))


def open_catalog(location: str | os.PathLike, kv) -> DocumentCatalog:
    """The catalog of the store at ``location``: a file beside LMDB, or a hash in Redis."""
    if is_redis_url(location):
        return RedisDocumentCatalog(kv)
    return DocumentCatalog(location)


def _public(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "chunk_keys"}
