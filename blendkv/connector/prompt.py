"""The blended prompt: a prompt dict checked (:func:`parse_prompt`), then assembled from token-id
pieces (:class:`PromptBuilder`); nothing is re-tokenised after assembly.

The dict's keys: exactly one of ``documents`` (strings), ``chunks`` (token id lists) or
``chunk_ids`` (ids of stored chunks); ``query`` (a string or token ids); ``system`` and
``instruction`` (strings); ``continuation`` (token ids the prompt ends with). Anything else, an
empty chunk or a wrong type is an :class:`~blendkv.errors.InvalidRequestError` naming it.

    | template prefix (+ instruction) | chunk 0 | chunk 1 | ... | query | template suffix |
      always recomputed                 reused K/V from the store      always recomputed

The chat template is rendered once with a sentinel standing for the user content; the text
before and after it is tokenised on its own to give the exact prefix and suffix ids. Documents
and the query are tokenised separately (``add_special_tokens=False``) and the ids concatenated,
so a chunk's ids in a prompt are exactly the ids its K/V was stored under.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from blendkv.errors import InvalidRequestError
from blendkv.text import replace_lone_surrogates

_SENTINEL = "\u2063BLENDKV_CONTENT\u2063"
_ENCODE_CACHE = 256  # texts whose ids a builder remembers


@dataclass(frozen=True)
class BlendedPrompt:
    """A blended prompt: its ids and where each reusable chunk sits (absolute positions)."""

    token_ids: list[int]
    prefix_len: int
    chunks: list[list[int]]
    chunk_starts: list[int]
    query_start: int  # first position after the last chunk

    @functools.cached_property
    def chunk_spans(self) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` of every chunk (computed once: loading reads it per chunk)."""
        return tuple((s, s + len(c)) for s, c in zip(self.chunk_starts, self.chunks, strict=True))

    @property
    def num_chunk_tokens(self) -> int:
        return sum(len(c) for c in self.chunks)


def fold_system(messages: list[dict]) -> list[dict] | None:
    """``messages`` with a leading system message folded into the first user turn as
    ``system + "\n\n" + user`` (what Gemma 3's template does itself); None if there is no
    system message followed by a user one."""
    if len(messages) < 2 or messages[0].get("role") != "system":
        return None
    system, user = messages[0], messages[1]
    if user.get("role") != "user" or not isinstance(user.get("content"), str):
        return None
    content = f"{system.get('content') or ''}\n\n{user['content']}"
    return [{**user, "content": content}, *messages[2:]]


def apply_template(tokenizer, messages: list[dict], **kwargs):
    """``tokenizer.apply_chat_template(messages, **kwargs)``; a template that refuses a system
    role (Gemma 2's raises) gets the system text folded into the first user turn instead."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except TemplateError:
        folded = fold_system(messages)
        if folded is None:
            raise
        return tokenizer.apply_chat_template(folded, **kwargs)


class PromptBuilder:
    """Builds blended prompts for one tokenizer (and its chat template)."""

    def __init__(self, tokenizer, use_chat_template: bool = True) -> None:
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and bool(
            getattr(tokenizer, "chat_template", None)
        )
        # RAG prompts repeat the same documents: their ids are remembered (tokenizing them is a
        # visible share of the time to first token, docs/benchmarks.md).
        self._encode_cached = functools.lru_cache(maxsize=_ENCODE_CACHE)(self._encode)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` alone; lone surrogates become U+FFFD (see :mod:`blendkv.text`)."""
        return list(self._encode_cached(text))

    def _encode(self, text: str) -> tuple[int, ...]:
        text = replace_lone_surrogates(text, "blended prompt text")
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def template_pieces(self, system: str | None) -> tuple[list[int], list[int]]:
        """(prefix ids, suffix ids) around the user content of a one-turn chat."""
        if not self.use_chat_template:
            bos = self.tokenizer.bos_token_id
            return ([bos] if bos is not None else []), []
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": _SENTINEL})
        text = apply_template(self.tokenizer, messages, tokenize=False, add_generation_prompt=True)
        before, sep, after = text.partition(_SENTINEL)
        assert sep, "the chat template dropped the user content"
        return self.encode(before), self.encode(after)

    def anchor(self, system: str | None = None, instruction: str | None = None) -> list[int]:
        """The ids every chunk is precomputed behind: the template prefix (+ instruction)."""
        prefix, _ = self.template_pieces(system)
        return prefix + (self.encode(instruction) if instruction else [])

    def build(
        self,
        chunks: list[list[int]],
        query: str | list[int],
        system: str | None = None,
        instruction: str | None = None,
        continuation: list[int] | None = None,
    ) -> BlendedPrompt:
        """``continuation``: ids appended after the template suffix (e.g. an answer to score
        teacher-forced); like the query they are always recomputed."""
        prefix, suffix = self.template_pieces(system)
        if instruction:
            prefix = prefix + self.encode(instruction)
        query_ids = self.encode(query) if isinstance(query, str) else list(query)
        ids = list(prefix)
        starts = []
        for chunk in chunks:
            starts.append(len(ids))
            ids.extend(chunk)
        query_start = len(ids)
        ids.extend(query_ids)
        ids.extend(suffix)
        ids.extend(continuation or [])
        if len(ids) == query_start:
            raise InvalidRequestError("a blended prompt needs a query or a template suffix")
        return BlendedPrompt(ids, len(prefix), [list(c) for c in chunks], starts, query_start)


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
