"""Catalog <-> store agreement (blendkv.rag.consistency) beyond the killed ingest of
test_interrupted_ingest.py: no false alarm on chunks shared by documents, missing chunks found
and written again (only them), a failed catalog write rolled back."""

from __future__ import annotations

import pytest

from blendkv.rag.catalog import DocumentCatalog

pytestmark = pytest.mark.slow


def kinds(report) -> list[tuple[str, str]]:
    return [(p.kind, p.subject) for p in report.problems]


def test_chunks_shared_by_documents_are_not_a_problem(tiny_rag):
    text = "Quartz and marble lie under the cedar forest near the harbour."
    report = tiny_rag.ingest([text, text], doc_ids=["first", "second"], progress=False)
    assert report.added == ("first", "second")
    # Content-addressed: the second document's chunks are the first one's, stored once.
    assert tiny_rag.store.kv.document_chunks("second") == []
    assert tiny_rag.verify().ok
    again = tiny_rag.ingest([text, text], doc_ids=["first", "second"], progress=False)
    assert again.skipped == ("first", "second") and not again.repaired


def test_missing_chunks_are_reported_and_written_again(tiny_rag):
    text = (
        "A walrus, a falcon and an okapi met at the lighthouse by the tundra. The falcon "
        "spoke of saffron fields, the walrus of copper lanterns under the harbour ice, and "
        "the okapi of a cedar orchard where quartz and marble glitter after the rain."
    )
    [doc_id] = tiny_rag.add_documents([text], progress=False)
    chunks = tiny_rag.store.kv.document_chunks(doc_id)
    assert len(chunks) >= 2
    tiny_rag.store.kv.delete([chunks[1].key])  # e.g. evicted, or removed by hand
    tiny_rag.store.sync_index()
    assert kinds(tiny_rag.verify()) == [("doc_chunks_missing", doc_id)]
    report = tiny_rag.ingest([text], progress=False)
    # Resumed: only the missing chunk is computed; the others keep their chunk ids.
    assert report.repaired == (doc_id,) and report.num_chunks == 1
    assert report.reused_chunks == len(chunks) - 1
    assert tiny_rag.verify().ok
    after = tiny_rag.store.kv.document_chunks(doc_id)
    assert [m.key for m in after] == [m.key for m in chunks]
    kept = [m.chunk_id for i, m in enumerate(after) if i != 1]
    assert kept == [m.chunk_id for i, m in enumerate(chunks) if i != 1]


class FailingCatalog(DocumentCatalog):
    def put(self, doc_id, **entry):
        raise OSError("disk full")


def test_failed_catalog_write_rolls_the_document_back(tiny_rag):
    before = len(tiny_rag.store.kv)
    good = tiny_rag.catalog
    tiny_rag.catalog = FailingCatalog(tiny_rag.store_dir)
    try:
        with pytest.raises(OSError, match="disk full"):
            tiny_rag.add_documents(["Saffron and copper lanterns in the meadow."], progress=False)
    finally:
        tiny_rag.catalog = good
    assert len(tiny_rag.store.kv) == before
    assert tiny_rag.verify().ok
