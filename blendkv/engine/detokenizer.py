"""Incremental detokenisation: one text delta per generated token, for streaming.

Contract: the concatenation of every ``add()`` delta plus ``finish()`` equals
``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``.

Algorithm (vLLM's ``detokenize_incrementally``): decode only a small window of recent tokens::

    output ids:  ... | prefix_offset ........ read_offset ........ len(ids) |
                       \\__ already emitted __/ \\__ not yet emitted __/

    delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

The window starts one emission back so context-dependent decoders (SentencePiece, WordPiece)
see the new tokens as in the full text. A delta ending in U+FFFD (a split UTF-8 character) is
held back until a later token completes it; ``finish()`` flushes it. (``DecodeStream`` needs a
Rust tokenizer and cannot flush.)
"""

from __future__ import annotations

import functools
import re

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one request's output tokens as they arrive.

    The output text is defined by the output tokens alone, like transformers'
    ``decode(output_ids)``: ``prompt_token_ids`` is accepted for the vLLM-shaped constructor but
    does not influence the text (using the prompt tail as decoding context would give
    SentencePiece outputs a leading space that transformers does not produce).
    """

    def __init__(
        self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add(self, token_id: int) -> str:
        """Append one output token; return the newly readable text (maybe "")."""
        self.token_ids.append(token_id)
        window_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet (a skipped special token) or an incomplete UTF-8 character.
            return ""
        return self._emit(window_text)

    def finish(self) -> str:
        """Flush text held back at the end (an unfinished UTF-8 character); idempotent."""
        window_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text):
            return ""
        return self._emit(window_text)

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        self.text += delta
        return delta


# ----------------------------------------------------------------- logprob tokens
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable stand-in character -> its byte.

    Printable Latin-1 bytes stand for themselves; the others map to U+0100 onwards in byte
    order (the table transformers' GPT-2 tokenizer kept; not importable from every version)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes token ``token_id`` stands for, also when they are not a whole UTF-8 character.

    A token holding part of a multi-byte character (one of an emoji's four bytes) decodes alone
    to U+FFFD; its real bytes come from its vocabulary piece: ``<0xF0>`` (SentencePiece byte
    fallback) or the byte-level alphabet of GPT-2-style BPE. Other tokens: their text's UTF-8.
    """
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if _REPLACEMENT_CHAR not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        m = _BYTE_PIECE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        table = _byte_level_decoder()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return text.encode()


def logprob_token(tokenizer, token_id: int) -> tuple[str, bytes]:
    """``(token string, token bytes)`` as logprobs report them: the bytes are the token's own
    (:func:`token_bytes`); the string is their UTF-8 text, or, for bytes that are not whole
    characters, the bytes escaped as ``\\xf0\\x9f`` (OpenAI's form), so distinct byte tokens
    get distinct strings instead of all being "\ufffd"."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode(), raw
    except UnicodeDecodeError:
        return raw.decode("utf-8", "backslashreplace"), raw
