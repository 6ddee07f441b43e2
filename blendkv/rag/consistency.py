"""Where the document catalog and the chunk store disagree, and what ingest does about it.

    catalog (rag_documents.json)     chunk store (LMDB)               index (FAISS)
    doc id -> its chunk keys   <->   chunk key -> K/V, text, doc id  <->  chunk id -> vector

Ingest writes a document's chunks (store, then index) and only then its catalog entry, so a
killed ingest leaves stored chunks the catalog lacks. The store re-syncs its index itself;
here :func:`check_documents` reports catalog disagreements (``blendkv store verify``) and
:func:`document_action` tells a re-run of ingest how to repair a document: it resumes, writing
only the chunks that are not stored. Loads no model.
"""

from __future__ import annotations

import enum
from collections import defaultdict

from blendkv.rag.catalog import DocumentCatalog

_SHOWN = 8  # chunk ids / positions listed in one problem


class DocumentAction(enum.Enum):
    SKIP = "skip"  # in the catalog and every chunk of its entry stored
    ADD = "add"  # neither stored nor in the catalog
    CATALOG = "catalog"  # every chunk stored, the catalog entry missing: write only the entry
    # Some chunks stored (an interrupted ingest; chunks evicted or deleted by hand): write the
    # missing ones, release stored ones today's chunking lacks, then write the entry.
    RESUME = "resume"


def document_action(catalog: DocumentCatalog, kv, doc_id: str, keys: list[bytes]) -> DocumentAction:
    """What ingest must do for ``doc_id``, whose chunks as chunked now have ``keys``.

    A document in the catalog is checked against its recorded keys (the chunking it was
    ingested with, which may differ from today's ``chunk_tokens``); one missing from the
    catalog against ``keys``. ``kv`` is the :class:`~blendkv.store.KVStore`.
    """
    owned = {m.key for m in kv.document_chunks(doc_id)}
    if doc_id in catalog:
        recorded = catalog.chunk_keys(doc_id)
        if recorded is None:  # an entry written before keys were recorded: trust positions
            complete = len(owned) == catalog.get(doc_id)["num_chunks"]
        else:
            complete = owned <= set(recorded) and all(k in kv for k in recorded)
        return DocumentAction.SKIP if complete else DocumentAction.RESUME
    if not owned:
        return DocumentAction.ADD
    if owned <= set(keys) and all(k in kv for k in keys):
        return DocumentAction.CATALOG
    return DocumentAction.RESUME


def check_documents(catalog: DocumentCatalog, kv, report) -> None:
    """Add to ``report`` (a :class:`~blendkv.store.VerifyReport`) every document on which the
    catalog and the store ``kv`` disagree:

    * ``doc_not_in_catalog``: chunks stored under a doc id the catalog lacks;
    * ``doc_chunks_missing``: chunks of a catalog entry that are not stored;
    * ``doc_chunks_extra``: chunks stored under a document that its entry does not list.

    Ingesting the document again repairs each of them.
    """
    stored: set[bytes] = set()
    owned = defaultdict(list)
    for meta in kv.iter_meta():
        stored.add(meta.key)
        if meta.doc_id is not None:
            owned[meta.doc_id].append(meta)
    docs = catalog.documents()
    for doc_id in sorted(owned.keys() - docs.keys()):
        metas = sorted(owned[doc_id], key=lambda m: m.position)
        start = " ".join(metas[0].text.split())[:60]
        report.add(
            "doc_not_in_catalog",
            doc_id,
            f"{len(metas)} chunk(s) stored (positions {_listed(m.position for m in metas)}) but "
            f"the document is not in the catalog (an interrupted ingest?); its text starts "
            f"{start!r}; ingest it again to repair",
        )
    for doc_id, entry in sorted(docs.items()):
        recorded = catalog.chunk_keys(doc_id)
        mine = owned.get(doc_id, [])
        if recorded is None:
            if len(mine) != entry["num_chunks"]:
                report.add(
                    "doc_chunks_missing",
                    doc_id,
                    f"the catalog lists {entry['num_chunks']} chunk(s), {len(mine)} are stored; "
                    "ingest it again to repair",
                )
            continue
        missing = [pos for pos, key in enumerate(recorded) if key not in stored]
        if missing:
            report.add(
                "doc_chunks_missing",
                doc_id,
                f"{len(missing)} of its {len(recorded)} chunk(s) are not stored (positions "
                f"{_listed(missing)}); ingest it again to repair",
            )
        listed = set(recorded)
        extra = sorted(m.chunk_id for m in mine if m.key not in listed)
        if extra:
            report.add(
                "doc_chunks_extra",
                doc_id,
                f"stored chunk(s) {_listed(extra)} are not in its catalog entry; ingest it again "
                "to repair",
            )


def _listed(values) -> str:
    values = list(values)
    shown = ", ".join(str(v) for v in values[:_SHOWN])
    return shown + (f", ... ({len(values)} in all)" if len(values) > _SHOWN else "")
