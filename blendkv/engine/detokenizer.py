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
