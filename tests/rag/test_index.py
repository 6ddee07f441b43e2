"""FAISS chunk index, the ChunkStore facade, and retrieval with the real MiniLM embedder."""

from __future__ import annotations

import numpy as np
import pytest
from store_helpers import key_of, make_kv

from blendkv.rag.chunk_store import ChunkStore
from blendkv.rag.embedding import MiniLMEmbedder
from blendkv.rag.index import ChunkIndex
from blendkv.store.errors import EmbedderMismatchError, StoreFullError
from blendkv.store.records import NewChunk


def _unit(n: int, dim: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_index_add_remove_search_persist(tmp_path, kind):
    v = _unit(400, 16)
    index = ChunkIndex(16, "emb", kind, ivf_nlist=4)
    index.add(np.arange(400) + 10, v)
    assert index.is_ivf_trained == (kind == "ivf")
    assert [index.search(v[i], 1)[0][0] for i in range(400)] == list(range(10, 410))
    assert index.remove([15, 16, 999]) == 2 and len(index) == 398
    assert sorted(index.ids().tolist()) == [i for i in range(10, 410) if i not in (15, 16)]
    assert index.search(v[5], 1)[0][0] != 15
    index.save(tmp_path / "ix")
    loaded = ChunkIndex.load(tmp_path / "ix", "emb", 16)
    assert [loaded.search(v[i], 1)[0][0] for i in (0, 7, 399)] == [10, 17, 409]
    assert loaded.remove([17]) == 1 and 17 not in loaded.ids().tolist()
    with pytest.raises(EmbedderMismatchError, match="emb"):
        ChunkIndex.load(tmp_path / "ix", "other-embedder", 16)
    with pytest.raises(EmbedderMismatchError):
        ChunkIndex.load(tmp_path / "ix", "emb", 32)
    assert not list(tmp_path.glob("*.tmp*"))  # atomic save left no temp file


class HashEmbedder:
    """Deterministic bag-of-words embedder: fast, and retrieval on it is predictable."""

    name, dim = "test-hash-bow", 64

    def embed(self, texts):
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.lower().split():
                out[row, sum(word.encode()) % self.dim] += 1.0
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def _chunks(texts, doc_id, start=0):
    return [
        NewChunk(key_of(start + i), make_kv(start + i), text=t, doc_id=doc_id, position=i)
        for i, t in enumerate(texts)
    ]


def test_chunk_store_keeps_index_and_store_in_step(store_path, fp):
    with ChunkStore(store_path, fp, HashEmbedder(), max_bytes=4 * (64 + 512)) as cs:
        cs.add_chunks(_chunks(["alpha beta", "gamma delta"], "d1"))
        cs.add_chunks(_chunks(["computed at query time"], None, start=2))  # evictable
        assert cs.search("gamma delta", 1)[0].meta.text == "gamma delta"
        results = cs.add_chunks(_chunks(["zeta eta", "theta"], "d2", start=3))
        assert results[0].evicted == (2,)  # capacity 4: only the document-less chunk may go
        assert sorted(cs.index.ids().tolist()) == [0, 1, 3, 4] and cs.verify().ok
        with pytest.raises(StoreFullError, match="documents hold"):
            cs.add_chunks(_chunks(["iota"], "d3", start=5))  # documents are never evicted
        assert sorted(cs.index.ids().tolist()) == [0, 1, 3, 4] and cs.verify().ok
        assert sorted(cs.remove_document("d1")) == [0, 1]
        assert sorted(cs.index.ids().tolist()) == [3, 4] and cs.verify().ok
        assert [h.chunk_id for h in cs.search("theta", 5)] == [4, 3]
    with ChunkStore(store_path, fp, HashEmbedder()) as cs:  # persisted, still consistent
        assert sorted(cs.index.ids().tolist()) == [3, 4] and cs.verify().ok
        assert cs.kv.max_bytes == 4 * (64 + 512)  # the limit is saved in the store


def test_chunk_store_resyncs_index_after_crash_between_steps(store_path, fp):
    with ChunkStore(store_path, fp, HashEmbedder()) as cs:
        cs.add_chunks(_chunks(["one two", "three four"], "d"))
        cs.kv.put(key_of(9), make_kv(9), text="five six", doc_id="d2")  # stored, never indexed
        cs.index.add([77], HashEmbedder().embed(["ghost"]))  # indexed, never stored
        kinds = sorted(p.kind for p in cs.verify().problems)
        assert kinds == ["index_missing", "index_orphan"]
        cs.save_index()
    with ChunkStore(store_path, fp, HashEmbedder()) as cs:
        assert cs.verify().ok and cs.search("five six", 1)[0].chunk_id == 2


def test_write_back_chunks_are_cached_but_not_indexed(store_path, fp):
    """K/V written back at query time (no document) is a cache entry, not a search result."""
    with ChunkStore(store_path, fp, HashEmbedder()) as cs:
        cs.add_chunks(_chunks(["one two"], "d"))
        cs.add_chunks([NewChunk(key_of(5), make_kv(5), text="five six")])
        assert len(cs.kv) == 2 and cs.index.ids().tolist() == [0]
        assert cs.verify().ok
    with ChunkStore(store_path, fp, HashEmbedder()) as cs:  # reopen runs sync_index
        assert cs.index.ids().tolist() == [0] and cs.verify().ok


def test_chunk_store_refuses_index_of_other_embedder(store_path, fp):
    with ChunkStore(store_path, fp, HashEmbedder()) as cs:
        cs.add_chunks(_chunks(["x"], "d"))

    class Other(HashEmbedder):
        name = "another"

    with pytest.raises(EmbedderMismatchError):
        ChunkStore(store_path, fp, Other())
    ChunkStore(store_path, fp, HashEmbedder()).close()  # the refused open released the store


PASSAGES = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, France.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar.",
    "The Great Barrier Reef off Australia is the largest coral reef system.",
    "Python is a programming language known for its readable syntax.",
    "Mount Everest is Earth's highest mountain above sea level, in the Himalayas.",
]


@pytest.fixture(scope="module")
def minilm():
    return MiniLMEmbedder()


def test_minilm_embeddings_are_unit_length_and_batched(minilm):
    v = minilm.embed(PASSAGES)
    assert v.shape == (5, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    small = MiniLMEmbedder(batch_size=2)
    small._tokenizer, small._model = minilm._tokenizer, minilm._model
    assert np.allclose(small.embed(PASSAGES), v, atol=1e-5)


@pytest.mark.parametrize(
    "query, expected",
    [
        ("Which tower stands in the French capital?", 0),
        ("How do plants make food from light?", 1),
        ("What is the tallest mountain in the world?", 4),
        ("coral reefs near Australia", 2),
    ],
)
def test_retrieval_with_minilm(store_path, fp, minilm, query, expected):
    with ChunkStore(store_path, fp, minilm) as cs:
        cs.add_chunks(_chunks(PASSAGES, "wiki"))
        hits = cs.search(query, 3)
        assert hits[0].meta.position == expected and hits[0].score > hits[1].score


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_index_search_among_ids_is_exact(kind):
    """A search restricted to some ids returns the k best of exactly those (a brute-force
    oracle), whatever the index kind; k larger than the allowed set returns all of them."""
    v = _unit(400, 16, seed=1)
    index = ChunkIndex(16, "emb", kind, ivf_nlist=8, ivf_nprobe=1)
    index.add(np.arange(400) + 10, v)
    assert index.is_ivf_trained == (kind == "ivf")
    rng = np.random.default_rng(2)
    for trial in range(20):
        allowed = rng.choice(400, size=int(rng.integers(1, 60)), replace=False) + 10
        query = _unit(1, 16, seed=100 + trial)[0]
        k = int(rng.integers(1, 12))
        got = index.search(query, k, ids=list(allowed) + [9999])  # an absent id is ignored
        scores = v[allowed - 10] @ query
        want = allowed[np.argsort(-scores, kind="stable")][: min(k, len(allowed))]
        assert [cid for cid, _ in got] == want.tolist()
        assert all(cid in set(allowed.tolist()) for cid, _ in got)
    assert index.search(_unit(1, 16)[0], 5, ids=[]) == []
    assert index.search(_unit(1, 16)[0], 5, ids=[12345]) == []
