"""Retrieval returns only chunks of catalogued documents: the chunks of a half-ingested
document (stored and indexed, its catalog entry never written) are passed over even where
they are the closest to the question, and ``k`` chunks still come back from the catalogued
documents when they hold that many, with and without a filter."""

from __future__ import annotations

import pytest

from blendkv.rag.catalog import DocumentCatalog

pytestmark = pytest.mark.slow

QUESTION = "Which bird sings at the old lighthouse?"
HALF = (
    "The lighthouse bird sings at the old lighthouse every night. The bird that sings at the "
    "lighthouse is a falcon, and the falcon sings at the old lighthouse until dawn. Keepers of "
    "the old lighthouse say the bird sings louder than the sea. The lighthouse bird sings."
)
CATALOGUED = [
    "Copper lanterns hang in the harbour. Marble steps lead from the harbour to the market, "
    "where saffron and quartz are sold by the walrus traders of the tundra.",
    "The cedar orchard grows on the prairie. Okapi graze under the cedar trees, and an ember "
    "glows in the orchard keeper's hut beside the violin maker's shed.",
    "A glacier feeds the river below the volcano. Beetles cross the meadow by the river, and "
    "the hill above the forest keeps the snow until the summer.",
]


class InterruptedAtTheCatalog(DocumentCatalog):
    """An ingest interrupted (Ctrl-C here) after the document's chunks were stored and indexed,
    before its catalog entry: the state a SIGKILL or a container stop leaves."""

    def put(self, doc_id, **entry):
        raise KeyboardInterrupt


@pytest.fixture(scope="module")
def half_ingested(tiny_rag):
    """(pipeline, catalogued doc ids, chunk ids of the half-ingested document)."""
    rag = tiny_rag
    done = rag.ingest(CATALOGUED, progress=False).doc_ids
    good = rag.catalog
    rag.catalog = InterruptedAtTheCatalog(rag.store_dir)
    try:
        with pytest.raises(KeyboardInterrupt):
            rag.ingest([HALF], doc_ids=["half"], progress=False)
    finally:
        rag.catalog = good
    orphans = {m.chunk_id for m in rag.store.kv.document_chunks("half")}
    assert orphans and "half" not in rag.documents()
    assert orphans <= set(rag.store.index.ids().tolist())  # stored and indexed
    return rag, set(done), orphans


def test_the_half_ingested_document_is_what_the_index_finds_first(half_ingested):
    rag, _, orphans = half_ingested
    raw = [hit.chunk_id for hit in rag.store.search(QUESTION, 3)]
    # so a retrieval that trusted the index would return them
    assert raw[0] in orphans and len(set(raw) & orphans) >= 2


def test_retrieval_passes_over_chunks_of_no_catalogued_document(half_ingested):
    rag, done, orphans = half_ingested
    catalogued = sum(len(rag.store.kv.document_chunks(d)) for d in done)
    for k in (1, 3, catalogued):
        chunks = rag.retrieve(QUESTION, k)
        assert len(chunks) == k  # k of the catalogued documents' chunks
        assert {c.doc_id for c in chunks} <= done and not {c.chunk_id for c in chunks} & orphans
        assert all(c.source is not None or c.doc_id in done for c in chunks)
    everything = rag.retrieve(QUESTION, catalogued + len(orphans) + 5)
    assert len(everything) == catalogued  # all there are, none of the half document's


def test_a_filter_passes_over_them_too(half_ingested):
    rag, done, orphans = half_ingested
    two = sorted(done)[:2]
    chunks = rag.retrieve(QUESTION, 2, filter={"doc_id": two})
    assert len(chunks) == 2 and {c.doc_id for c in chunks} <= set(two)
    assert not {c.chunk_id for c in chunks} & orphans


def test_a_rerun_catalogues_the_document_and_it_is_found(half_ingested):
    rag, _, orphans = half_ingested
    report = rag.ingest([HALF], doc_ids=["half"], progress=False)
    assert report.repaired == ("half",) and report.num_chunks == 0  # resumed: nothing computed
    best = rag.retrieve(QUESTION, 1)[0]
    assert best.doc_id == "half" and best.chunk_id in orphans
