"""Documents by source, without a model: retrieval names each chunk's document (source,
metadata), a filter searches only the documents it selects, and deleting a document keeps
the chunks another document shares (handed to it), with store, index and catalog agreeing.

Two documents share a chunk (content-addressed, so stored once, owned by the first); a
bag-of-words embedder makes the ranking predictable.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blendkv.rag.catalog import DocumentCatalog
from blendkv.rag.chunk_store import ChunkStore
from blendkv.rag.consistency import check_documents
from blendkv.rag.deletion import delete_document
from blendkv.rag.errors import InvalidFilterError, NoChunksError
from blendkv.rag.filters import check_filter, document_matches, parse_filter_args
from blendkv.rag.retrieval import retrieve_chunks
from blendkv.store import NewChunk
from blendkv.store.fingerprint import ModelFingerprint

FP = ModelFingerprint(
    architecture="LlamaForCausalLM",
    weights_hash="w" * 8,
    dtype="float32",
    tokenizer_hash="t" * 8,
    rope={"rope_theta": 10000.0, "rope_scaling": None},
    anchor_token_ids=(1,),
    num_layers=1,
    num_kv_heads=1,
    head_dim=2,
)
SHARED = "shared licence text of the bundle"
TEXTS = {
    "doc-a": ["shared licence text of the bundle", "apples grow on trees in the orchard"],
    "doc-b": ["shared licence text of the bundle", "apples and pears grow in valleys"],
    "doc-c": ["copper bridge opened to trains"],
}
SOURCES = {"doc-a": "docs/a.md", "doc-b": "docs/b.md", "doc-c": None}
METADATA = {"doc-a": {"lang": "en", "year": 2024}, "doc-b": {"lang": "fr"}, "doc-c": {}}


class BagOfWords:
    name, dim = "test-bow", 64

    def embed(self, texts):
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.lower().split():
                out[row, sum(word.encode()) % self.dim] += 1.0
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def _key(text: str) -> bytes:
    return text.encode().ljust(16, b".")[:16]


@pytest.fixture
def docs(tmp_path):
    """(store, catalog) holding doc-a, doc-b (sharing their first chunk) and doc-c."""
    store = ChunkStore(tmp_path / "s", FP, BagOfWords())
    catalog = DocumentCatalog(tmp_path / "s")
    for doc_id, texts in TEXTS.items():
        chunks = [
            NewChunk(_key(t), torch.zeros(1, 2, 1, 1, 2), t, (7,), doc_id, pos)
            for pos, t in enumerate(texts)
        ]
        store.add_chunks(chunks)
        keys = [c.key for c in chunks]
        catalog.put(doc_id, source=SOURCES[doc_id], metadata=METADATA[doc_id], chunk_keys=keys)
    yield store, catalog
    store.close()


def _consistent(store, catalog) -> bool:
    report = store.verify()
    check_documents(catalog, store.kv, report)
    return report.ok


def test_shared_chunk_is_stored_once_and_named_by_its_owner(docs):
    store, catalog = docs
    assert len(store.kv) == 4 and _consistent(store, catalog)
    [hit] = retrieve_chunks(store, catalog, SHARED, 1)
    assert (hit.doc_id, hit.source, hit.position) == ("doc-a", "docs/a.md", 0)
    assert hit.metadata == {"lang": "en", "year": 2024}
    assert hit.retriever_metadata()["source"] == "docs/a.md"
    assert hit.to_dict()["source"] == "docs/a.md"


def test_filter_excludes_other_sources(docs):
    store, catalog = docs
    # Unfiltered, doc-b's own chunk ranks first for this question...
    question = "apples and pears grow in valleys"
    assert retrieve_chunks(store, catalog, question, 1)[0].doc_id == "doc-b"
    # ...filtered to docs/a.md, only doc-a's chunks come back, k of them.
    hits = retrieve_chunks(store, catalog, question, 3, {"source": "docs/a.md"})
    assert [(h.doc_id, h.position) for h in hits] == [("doc-a", 1), ("doc-a", 0)]
    # The shared chunk, owned by doc-a, is doc-b's under a filter that selects doc-b only.
    hits = retrieve_chunks(store, catalog, SHARED, 5, {"lang": "fr"})
    assert [(h.doc_id, h.source, h.position) for h in hits][0] == ("doc-b", "docs/b.md", 0)
    assert {h.doc_id for h in hits} == {"doc-b"} and len(hits) == 2
    # A list is any of; metadata, doc_id and a callable select too.
    assert {h.doc_id for h in retrieve_chunks(store, catalog, "x", 9, {"doc_id": ["doc-c"]})} == {
        "doc-c"
    }
    both = retrieve_chunks(store, catalog, "x", 9, {"source": ["docs/a.md", "docs/b.md"]})
    assert len(both) == 3 and {h.doc_id for h in both} == {"doc-a", "doc-b"}
    by_year = retrieve_chunks(store, catalog, "x", 9, lambda e: e["metadata"].get("year") == 2024)
    assert {h.doc_id for h in by_year} == {"doc-a"}
    with pytest.raises(NoChunksError, match="no document matches the filter"):
        retrieve_chunks(store, catalog, "x", 3, {"source": "docs/missing.md"})


def test_filter_values():
    entry = {"source": "docs/a.md", "metadata": {"year": 2024, "tags": ["x", "y"], "ok": True}}
    assert document_matches({"year": 2024, "tags": "y"}, "d", entry)
    assert not document_matches({"year": "2024"}, "d", entry)  # the Python API is typed
    assert not document_matches({"ok": 1}, "d", entry)  # True is not 1 here
    assert not document_matches({"missing": None}, "d", entry)
    cli = parse_filter_args(["year=2024", "source=docs/b.md", "source=docs/a.md"])
    assert document_matches(cli, "d", entry)  # the CLI's strings match typed values too
    assert not document_matches(parse_filter_args(["year=2025"]), "d", entry)
    with pytest.raises(InvalidFilterError, match="key=value"):
        parse_filter_args(["year"])
    with pytest.raises(InvalidFilterError):
        check_filter(["source", "docs/a.md"])


def test_delete_keeps_the_chunks_other_documents_share(docs):
    store, catalog = docs
    shared_id = store.kv.get_meta(_key(SHARED)).chunk_id
    done = delete_document(store, catalog, "doc-a")
    assert (done.removed, done.kept, done.source) == (1, 1, "docs/a.md")
    assert "doc-a" not in catalog and _consistent(store, catalog)
    # The shared chunk stays, in store and index, now doc-b's (its first chunk).
    meta = store.kv.get_meta(_key(SHARED))
    assert (meta.chunk_id, meta.doc_id, meta.position) == (shared_id, "doc-b", 0)
    assert shared_id in store.index.ids().tolist()
    [hit] = retrieve_chunks(store, catalog, SHARED, 1)
    assert (hit.doc_id, hit.source) == ("doc-b", "docs/b.md")
    assert all(h.doc_id != "doc-a" for h in retrieve_chunks(store, catalog, "apples", 9))
    # Deleting the last user deletes it.
    assert delete_document(store, catalog, "doc-b").removed == 2
    assert _key(SHARED) not in store.kv and len(store.index) == 1
    assert _consistent(store, catalog)
    # An unknown document is a no-op.
    assert delete_document(store, catalog, "doc-a").removed == 0


def test_catalog_finds_a_document_by_id_or_source(docs):
    _, catalog = docs
    assert catalog.find("doc-c") == ["doc-c"]
    assert catalog.find("docs/b.md") == ["doc-b"] == catalog.find("./docs//b.md")
    assert catalog.find("docs/z.md") == []
    assert catalog.key_documents()[_key(SHARED)] == ["doc-a", "doc-b"]
