"""Split a document into chunks on token ids (never by re-tokenising text).

Boundaries are chosen, in order of preference, at a paragraph end (a run of >= 2 newlines),
at a sentence end (``.``, ``!`` or ``?``, optionally closed by quotes or brackets, followed by
whitespace), else by a hard split at ``target_tokens``. Each chunk is at most
``target_tokens + max_overshoot`` tokens and its text is exactly ``tokenizer.decode(ids)``.

Boundary detection decodes single tokens and token pairs (the pair shows whether whitespace
follows punctuation for BPE, WordPiece and SentencePiece alike); it is deterministic.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_SENTENCE_END = re.compile(r"[.!?][\"')\]\u201d\u2019]*\s")


@dataclass(frozen=True)
class TextChunk:
    """Tokens ``[start, end)`` of the document, and their decoded text."""

    token_ids: tuple[int, ...]
    text: str
    start: int
    end: int


def _boundary_kinds(ids: Sequence[int], tokenizer) -> list[int]:
    """kinds[i] = 2 if a paragraph ends after token i, 1 for a sentence end, else 0."""
    pieces = [tokenizer.decode([t]) for t in ids]
    kinds = [0] * len(ids)
    newlines = 0  # newlines at the end of the text so far (spaces between them ignored)
    for i, piece in enumerate(pieces):
        stripped = piece.rstrip(" \t")
        if stripped and stripped.strip("\n") == "":
            newlines += stripped.count("\n")
        else:
            newlines = len(stripped) - len(stripped.rstrip("\n"))
        nxt = pieces[i + 1] if i + 1 < len(pieces) else ""
        if newlines >= 2 and not nxt.lstrip(" \t").startswith("\n"):
            kinds[i] = 2
        elif i + 1 < len(ids) and _SENTENCE_END.search(tokenizer.decode([ids[i], ids[i + 1]])):
            if re.search(r"[.!?][\"')\]\u201d\u2019]*\s*$", piece):
                kinds[i] = 1
    return kinds


def chunk_token_ids(
    token_ids: Sequence[int],
    tokenizer,
    target_tokens: int = 256,
    max_overshoot: int | None = None,
    min_tokens: int | None = None,
) -> list[TextChunk]:
    """Chunks of about ``target_tokens`` tokens, cut at the best boundary in range.

    A boundary is searched in ``[start + min_tokens, start + target_tokens + max_overshoot]``
    (defaults: ``target_tokens // 2`` and ``target_tokens // 10``); the last such paragraph
    end wins, else the last sentence end, else the chunk is cut at ``target_tokens``.
    """
    if target_tokens <= 0:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    overshoot = target_tokens // 10 if max_overshoot is None else max_overshoot
    min_len = max(1, target_tokens // 2 if min_tokens is None else min_tokens)
    ids = [int(t) for t in token_ids]
    kinds = _boundary_kinds(ids, tokenizer)
    chunks, start, n = [], 0, len(ids)
    while start < n:
        limit = start + target_tokens + overshoot
        if n <= limit:
            end = n
        else:
            end = start + target_tokens  # hard split unless a boundary is found
            for wanted in (2, 1):
                found = [i + 1 for i in range(start + min_len - 1, limit) if kinds[i] == wanted]
                if found:
                    end = found[-1]
                    break
        piece = tuple(ids[start:end])
        chunks.append(TextChunk(piece, tokenizer.decode(list(piece)), start, end))
        start = end
    return chunks
