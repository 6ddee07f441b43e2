"""A blended prompt dict checked and turned into token ids (``BlendManager.prepare``'s input).

The keys: exactly one of ``documents`` (strings), ``chunks`` (token id lists) or ``chunk_ids``
(ids of stored chunks); ``query`` (a string or token ids); ``system`` and ``instruction``
(strings); ``continuation`` (token ids the prompt ends with). Anything else, an empty chunk or a
wrong type is an :class:`~blendkv.errors.InvalidRequestError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from blendkv.errors import InvalidRequestError

ALLOWED_KEYS = frozenset(
    {"documents", "chunks", "chunk_ids", "query", "system", "instruction", "continuation"}
)


@dataclass
class PromptInput:
    chunks: list[list[int]]
    query: str | list[int]
    system: str | None
    instruction: str | None
    continuation: list[int]


def parse_prompt(
    prompt: dict,
    encode: Callable[[str], list[int]],
    stored_tokens: Callable[[int], list[int] | None],
) -> PromptInput:
    """``prompt``'s parts; ``encode`` tokenizes a document, ``stored_tokens`` gives a stored
    chunk's token ids by id (None: no such chunk)."""
    unknown = set(prompt) - ALLOWED_KEYS
    if unknown:
        raise InvalidRequestError(f"unknown keys in blended prompt: {sorted(unknown)}")
    chunks = _chunks(prompt, encode, stored_tokens)
    query = prompt.get("query", "")
    if not isinstance(query, (str, list)):
        raise InvalidRequestError("'query' must be a string or a list of token ids")
    for key in ("system", "instruction"):
        if prompt.get(key) is not None and not isinstance(prompt[key], str):
            raise InvalidRequestError(f"'{key}' must be a string")
    continuation = prompt.get("continuation") or []
    if not isinstance(continuation, list) or not _token_ids(continuation):
        raise InvalidRequestError("'continuation' must be a list of token ids")
    return PromptInput(chunks, query, prompt.get("system"), prompt.get("instruction"), continuation)


def _token_ids(items) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def _chunks(prompt: dict, encode, stored_tokens) -> list[list[int]]:
    given = [k for k in ("documents", "chunks", "chunk_ids") if k in prompt]
    if len(given) != 1:
        raise InvalidRequestError(
            "a blended prompt needs exactly one of 'documents' (strings), 'chunks' (token "
            f"id lists) or 'chunk_ids' (stored chunk ids); got {given or 'none'}"
        )
    kind = given[0]
    items = prompt[kind]
    if not isinstance(items, (list, tuple)):
        raise InvalidRequestError(f"'{kind}' must be a list")
    chunks = []
    for i, item in enumerate(items):
        if kind == "documents":
            if not isinstance(item, str):
                raise InvalidRequestError(f"document {i} is not a string")
            ids = encode(item)
        elif kind == "chunks":
            if not isinstance(item, (list, tuple)) or not _token_ids(item):
                raise InvalidRequestError(f"chunk {i} is not a list of token ids")
            ids = list(item)
        else:
            ids = stored_tokens(int(item))
            if ids is None:
                raise InvalidRequestError(f"stored chunk id {item} does not exist")
        if not ids:
            raise InvalidRequestError(f"{kind[:-1]} {i} is empty (zero tokens)")
        chunks.append(ids)
    return chunks
