"""Deleting a document: its chunks leave store, index and catalog, except those another
document uses.

Chunks are content-addressed: a chunk equal in two documents is stored once, owned (its
metadata's ``doc_id``) by the document that wrote it first, and listed in both catalog entries.
Deleting a document therefore

1. hands each chunk it owns that another catalogued document lists to that document
   (:meth:`KVStore.reassign <blendkv.store.KVStore.reassign>`: owner and position), so the other
   document stays whole and ``store verify`` clean;
2. deletes its other chunks (those it owns and those its entry lists that no other document
   lists) from store and index;
3. removes its catalog entry, last: a delete that was interrupted is finished by running it
   again.

Loads no model: ``blendkv docs delete`` runs it on a store opened in inspect mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from blendkv.rag.catalog import DocumentCatalog


@dataclass(frozen=True)
class DeletedDocument:
    """What deleting ``doc_id`` did: ``removed`` chunks left store and index, ``kept`` chunks
    stay because another document uses them."""

    doc_id: str
    source: str | None
    removed: int
    kept: int


def delete_document(store, catalog: DocumentCatalog, doc_id: str) -> DeletedDocument:
    """Delete ``doc_id`` from ``store`` (a :class:`~blendkv.rag.chunk_store.ChunkStore`) and
    ``catalog`` as the module docstring says; a document neither lists nor stores is a no-op."""
    kv = store.kv
    source = catalog.get(doc_id).get("source")
    owned = kv.document_chunks(doc_id)
    listed = catalog.chunk_keys(doc_id) or []
    users = catalog.key_documents()

    def heirs(key: bytes) -> list[str]:
        return [d for d in users.get(key, ()) if d != doc_id]

    moves = []
    for meta in owned:
        if others := heirs(meta.key):
            heir_keys = catalog.chunk_keys(others[0])
            assert heir_keys is not None  # it lists the key
            moves.append((meta.key, others[0], heir_keys.index(meta.key)))
    mine = list(dict.fromkeys([m.key for m in owned] + listed))
    doomed = [key for key in mine if not heirs(key)]
    if moves:
        kv.reassign(moves)
    removed = store.remove_chunks(doomed)
    catalog.remove(doc_id)
    return DeletedDocument(doc_id, source, len(removed), len(mine) - len(doomed))
