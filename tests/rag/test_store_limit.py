"""A store limit smaller than a folder: ingest refuses it with ``StoreFullError`` before any
write, the store stays consistent, and the limit is saved in the store; a write past the limit
that the projection let through rolls its document back."""

from __future__ import annotations

import pytest
from helpers import QuietLLM

from blendkv.rag import RAGPipeline
from blendkv.store import StoreFullError
from blendkv.store.capacity import kv_bytes_per_token

pytestmark = pytest.mark.timeout(600)

WORDS = "river stone lantern orchard meadow harbor violet copper".split()


def _folder(tmp_path, n: int = 3):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(n):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(60)) + f" file {i}."
        (folder / f"doc{i}.txt").write_text(text)
    return folder


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with QuietLLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False) as llm:
        yield llm


def test_a_folder_larger_than_the_limit_is_refused_before_any_write(llm, tmp_path):
    folder = _folder(tmp_path)
    store = tmp_path / "store"
    manager = llm.blend_manager()
    tokens = len(manager.builder.encode((folder / "doc0.txt").read_text()))
    limit = int(1.5 * tokens * kv_bytes_per_token(manager.fingerprint))  # one file, not three
    plans = []
    with RAGPipeline(store, llm=llm, chunk_tokens=32, store_max_bytes=limit) as rag:
        with pytest.raises(StoreFullError, match="does not fit its limit"):
            rag.ingest([folder], progress=False, on_plan=plans.append)
        assert plans[0].projected > limit and plans[0].max_bytes == limit
        assert len(rag.store.kv) == 0 and rag.documents() == {} and rag.verify().ok
    with RAGPipeline(store, llm=llm, chunk_tokens=32) as rag:  # the limit was saved
        assert rag.store.kv.max_bytes == limit
        with pytest.raises(StoreFullError):
            rag.ingest([folder], progress=False)
        rag.ingest([folder / "doc0.txt"], progress=False)  # one file fits
        assert len(rag.documents()) == 1 and rag.verify().ok


def test_a_write_past_the_limit_rolls_its_document_back(llm, tmp_path):
    folder = _folder(tmp_path, 2)
    store = tmp_path / "store"
    with RAGPipeline(store, llm=llm, chunk_tokens=32) as rag:
        rag.ingest([folder / "doc0.txt"], progress=False)
        held = rag.store.kv.stats().bytes
        kv = rag.store.kv

        def shrink(plan) -> None:  # the room goes after the projection (as to another writer)
            kv.max_bytes = held + plan.projected // 2

        with pytest.raises(StoreFullError, match="is full"):  # the write itself refuses
            rag.ingest([folder / "doc1.txt"], progress=False, on_plan=shrink)
        assert len(rag.documents()) == 1 and rag.store.kv.stats().bytes == held
        assert rag.verify().ok
