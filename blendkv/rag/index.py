"""FAISS index of chunk embeddings; FAISS ids are the store's chunk ids.

Kinds: ``"flat"`` (exact inner product, ``IndexIDMap2(IndexFlatIP)``), ``"ivf"`` (IVFFlat; it
stays exact/flat until ``ivf_train_size`` vectors exist, then is trained on them and
rebuilt) and ``"hnsw"`` (HNSWFlat; FAISS cannot delete from HNSW, so ``remove`` rebuilds it
from the kept vectors, O(n)). Vectors are expected unit-length, so inner product = cosine.

Saved as ONE file (so a rename makes it atomic): magic, a JSON header with the embedder's
name and dim and the index kind, then ``faiss.serialize_index`` bytes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import faiss
import numpy as np

from blendkv.store.errors import EmbedderMismatchError, StoreFormatError

_MAGIC = b"BKVIDX01"
KINDS = ("flat", "ivf", "hnsw")


class ChunkIndex:
    """Add / remove / search chunk embeddings by chunk id."""

    def __init__(
        self,
        dim: int,
        embedder_name: str,
        kind: str = "flat",
        *,
        ivf_nlist: int = 64,
        ivf_nprobe: int = 8,
        ivf_train_size: int | None = None,
        hnsw_m: int = 32,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"index kind must be one of {KINDS}, got {kind!r}")
        self.dim, self.embedder_name, self.kind = dim, embedder_name, kind
        self.ivf_nlist, self.ivf_nprobe, self.hnsw_m = ivf_nlist, ivf_nprobe, hnsw_m
        # FAISS warns below 39 training points per centroid.
        self.ivf_train_size = ivf_train_size or 39 * ivf_nlist
        self._index = self._empty(trained=False)

    def _empty(self, trained: bool) -> faiss.Index:
        if self.kind == "hnsw":
            base = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        elif self.kind == "ivf" and trained:
            quantizer = faiss.IndexFlatIP(self.dim)
            base = faiss.IndexIVFFlat(
                quantizer, self.dim, self.ivf_nlist, faiss.METRIC_INNER_PRODUCT
            )
            base.nprobe = self.ivf_nprobe  # faiss's wrapper keeps `quantizer` referenced
            # IVF takes ids itself: IndexIDMap2 over IVF mis-maps ids after remove_ids (it
            # assumes the sub-index compacts). A hash-table direct map allows reconstruct/remove.
            base.set_direct_map_type(faiss.DirectMap.Hashtable)
            return base
        else:
            base = faiss.IndexFlatIP(self.dim)
        return faiss.IndexIDMap2(base)

    @property
    def is_ivf_trained(self) -> bool:
        return isinstance(self._index, faiss.IndexIVF)

    def __len__(self) -> int:
        return self._index.ntotal

    def ids(self) -> np.ndarray:
        """Every chunk id in the index."""
        if not self.is_ivf_trained:
            return faiss.vector_to_array(self._index.id_map).astype(np.int64)
        invlists = self._index.invlists
        parts = [
            faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy()
            for i in range(invlists.nlist)
            if invlists.list_size(i)
        ]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def _check(self, vectors: np.ndarray) -> np.ndarray:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise ValueError(f"expected vectors of shape (n, {self.dim}), got {vectors.shape}")
        return vectors

    def add(self, chunk_ids, vectors: np.ndarray) -> None:
        vectors = self._check(vectors)
        ids = np.asarray(chunk_ids, dtype=np.int64).reshape(-1)
        if len(ids) != len(vectors):
            raise ValueError(f"{len(ids)} ids for {len(vectors)} vectors")
        self._index.add_with_ids(vectors, ids)
        if self.kind == "ivf" and not self.is_ivf_trained and len(self) >= self.ivf_train_size:
            self._rebuild(self.ids(), trained=True)

    def _vectors(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for row, cid in enumerate(ids):
            out[row] = self._index.reconstruct(int(cid))
        return out

    def _rebuild(self, keep_ids: np.ndarray, trained: bool) -> None:
        vectors = self._vectors(keep_ids)
        self._index = self._empty(trained=trained)
        if trained:
            self._index.train(vectors)
        if len(keep_ids):
            self._index.add_with_ids(vectors, keep_ids)

    def remove(self, chunk_ids) -> int:
        """Remove ids (absent ones are ignored); returns how many were removed."""
        ids = np.asarray(list(chunk_ids), dtype=np.int64)
        if not len(ids):
            return 0
        if self.kind == "hnsw":
            current = self.ids()
            keep = current[~np.isin(current, ids)]
            self._rebuild(keep, trained=False)
            return len(current) - len(keep)
        if self.is_ivf_trained:  # the hash-table direct map only accepts an id array
            return int(self._index.remove_ids(faiss.IDSelectorArray(len(ids), faiss.swig_ptr(ids))))
        return int(self._index.remove_ids(faiss.IDSelectorBatch(ids)))

    def search(self, query: np.ndarray, k: int, ids=None) -> list[tuple[int, float]]:
        """Top-``k`` ``(chunk_id, score)`` for one query vector, best first.

        ``ids`` (chunk ids) restricts the search to those chunks, exactly: the flat index
        skips the others (an ``IDSelector``), a trained IVF index does so while probing every
        list, and HNSW (whose graph walk a selector can cut short) scores them one by one.
        """
        query = self._check(np.asarray(query, dtype=np.float32).reshape(1, -1))
        if len(self) == 0 or k <= 0:
            return []
        if ids is None:
            scores, found = self._index.search(query, min(k, len(self)))
        else:
            scores, found = self._search_among(query, k, np.unique(np.asarray(ids, np.int64)))
        return [(int(i), float(s)) for i, s in zip(found[0], scores[0], strict=True) if i >= 0]

    def _search_among(self, query: np.ndarray, k: int, ids: np.ndarray):
        ids = ids[np.isin(ids, self.ids())]  # absent ids: reconstruct would raise
        k = min(k, len(ids))
        if k == 0:
            return np.zeros((1, 0), np.float32), np.zeros((1, 0), np.int64)
        selector = faiss.IDSelectorBatch(ids)
        if self.is_ivf_trained:
            params = faiss.SearchParametersIVF(sel=selector, nprobe=self.ivf_nlist)
            return self._index.search(query, k, params=params)
        if self.kind == "flat" or self.kind == "ivf":  # an untrained IVF is flat
            return self._index.search(query, k, params=faiss.SearchParameters(sel=selector))
        scores = self._index.reconstruct_batch(ids) @ query[0]
        best = np.argsort(-scores, kind="stable")[:k]
        return scores[best][None, :], ids[best][None, :]

    # ---- persistence -----------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write to a temp file beside ``path``, fsync, then rename over it (atomic)."""
        path = Path(path)
        header = json.dumps(
            {
                "embedder": self.embedder_name,
                "dim": self.dim,
                "kind": self.kind,
                "ivf_nlist": self.ivf_nlist,
                "ivf_nprobe": self.ivf_nprobe,
                "ivf_train_size": self.ivf_train_size,
                "hnsw_m": self.hnsw_m,
            }
        ).encode()
        blob = faiss.serialize_index(self._index)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + struct.pack("<I", len(header)) + header)
            f.write(memoryview(blob))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike, embedder_name: str, dim: int) -> ChunkIndex:
        """Load a saved index; refuses one built with another embedder."""
        data = Path(path).read_bytes()
        if not data.startswith(_MAGIC):
            raise StoreFormatError(f"{path} is not a blendkv chunk index")
        (hlen,) = struct.unpack_from("<I", data, len(_MAGIC))
        start = len(_MAGIC) + 4
        header = json.loads(data[start : start + hlen])
        if header["embedder"] != embedder_name or header["dim"] != dim:
            raise EmbedderMismatchError(
                f"index {path} was built with embedder {header['embedder']!r} "
                f"(dim {header['dim']}), not {embedder_name!r} (dim {dim}); rebuild it"
            )
        index = cls(
            dim,
            embedder_name,
            header["kind"],
            ivf_nlist=header["ivf_nlist"],
            ivf_nprobe=header["ivf_nprobe"],
            ivf_train_size=header["ivf_train_size"],
            hnsw_m=header["hnsw_m"],
        )
        blob = np.frombuffer(data, dtype=np.uint8, offset=start + hlen).copy()
        index._index = faiss.deserialize_index(blob)  # already downcast
        if index.is_ivf_trained:
            index._index.nprobe = index.ivf_nprobe
            index._index.set_direct_map_type(faiss.DirectMap.Hashtable)
        return index
