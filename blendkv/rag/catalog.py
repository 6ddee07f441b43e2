"""The document catalog: per-document facts the chunk store does not keep (source file, user
metadata, chunk count), as one JSON file beside the LMDB files.

The chunk store stays the source of truth for *which* chunks exist; the catalog is written
after the store (and rewritten atomically, via a temporary file and ``os.replace``), so a crash
in between leaves at worst a document without its metadata, never a half-written catalog.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

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
        return self._docs.get(doc_id, {}) if doc_id is not None else {}

    def documents(self) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in self._docs.items()}

    def put(self, doc_id: str, *, source: str | None, metadata: dict, num_chunks: int) -> None:
        self._docs[doc_id] = {
            "source": source,
            "metadata": metadata,
            "num_chunks": num_chunks,
            "added": time.time(),
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
