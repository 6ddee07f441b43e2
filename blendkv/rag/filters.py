"""Retrieval filters: which catalogued documents a search may return chunks of.

A filter is a dict or a callable. A dict's keys are ``"doc_id"``, ``"source"`` or keys of the
documents' metadata; a document matches when every key matches: its value equals the wanted
value, or one of them when a list/tuple/set is wanted, and a list in the metadata matches when
it holds a wanted value. A document without the key never matches. A callable gets the catalog
entry (``doc_id``, ``source``, ``metadata``, ``num_chunks``, ``added``) and returns a bool.

The filter selects documents in the catalog; the search then runs among their chunks only
(:meth:`blendkv.rag.chunk_store.ChunkStore.search` with ``ids``), so it returns the ``k`` best
matching chunks, never fewer while enough match.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from blendkv.rag.errors import InvalidFilterError

DocumentFilter = Mapping[str, Any] | Callable[[dict[str, Any]], bool]
_TOP_LEVEL = ("doc_id", "source")


def check_filter(filter: Any) -> DocumentFilter | None:
    """``filter`` if it is None, a dict with string keys, or a callable; else a typed error."""
    if filter is None or callable(filter):
        return filter
    if not isinstance(filter, Mapping) or not all(isinstance(k, str) for k in filter):
        raise InvalidFilterError(
            f"a filter is a dict of metadata values (e.g. {{'source': 'docs/a.md'}}) or a "
            f"callable on the catalog entry, got {type(filter).__name__}"
        )
    return filter


def document_matches(filter: DocumentFilter, doc_id: str, entry: Mapping[str, Any]) -> bool:
    """Whether the catalog ``entry`` of ``doc_id`` passes ``filter`` (see the module doc)."""
    if callable(filter):
        return bool(filter({"doc_id": doc_id, **entry}))
    metadata = entry.get("metadata") or {}
    for key, wanted in filter.items():
        if key in _TOP_LEVEL:
            have = doc_id if key == "doc_id" else entry.get("source")
        elif key in metadata:
            have = metadata[key]
        else:
            return False
        wanted = list(wanted) if isinstance(wanted, (list, tuple, set, frozenset)) else [wanted]
        haves = have if isinstance(have, list) else [have]
        if not any(_equal(h, w) for h in haves for w in wanted):
            return False
    return True


def _equal(have: Any, wanted: Any) -> bool:
    # True == 1 in Python; a filter on a boolean must not match the number (nor the reverse).
    return have == wanted and isinstance(have, bool) == isinstance(wanted, bool)


def matching_documents(
    filter: DocumentFilter, documents: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """The doc ids of ``documents`` (doc id -> catalog entry) that pass ``filter``."""
    return [d for d, entry in documents.items() if document_matches(filter, d, entry)]


def parse_filter_args(pairs: list[str]) -> dict[str, list[Any]] | None:
    """``--filter key=value`` (repeatable) as a filter dict; a repeated key means any of its
    values. A value also matches its JSON reading (``year=2024`` matches 2024 and "2024")."""
    if not pairs:
        return None
    out: dict[str, list[Any]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidFilterError(f"--filter takes key=value, got {pair!r}")
        values = out.setdefault(key, [])
        values.append(value)
        try:
            parsed = json.loads(value)
        except ValueError:
            continue
        if isinstance(parsed, (int, float, bool)) or parsed is None:
            values.append(parsed)
    return out


def describe_filter(filter: DocumentFilter) -> str:
    """The filter as it reads in an error message."""
    if callable(filter):
        return getattr(filter, "__name__", "the filter callable")
    return json.dumps(dict(filter), ensure_ascii=False, default=str)
