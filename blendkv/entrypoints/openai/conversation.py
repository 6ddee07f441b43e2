"""Conversations with documents: where a chat's turns go in a blended prompt.

The documents attach to the conversation, inside its first user turn; everything after them is
ordinary computed text (the blended prompt's "query")::

    | template prefix (system) | doc 0 | doc 1 | ... | user 1 ... assistant 1 ... user N | gen |
      the one-turn prefix        reused K/V          recomputed: the conversation's turns

Every turn of the conversation has the same prefix and documents, so a follow-up turn reuses
the blended blocks of the prompt it shares with the turn before, documents included (prefix
caching: the blend's cache salt depends on the chunks and the blend config, not on the query);
documents whose blocks were evicted come from the request cache or the store as usual. The
turns are rendered by the model's own chat template, as text, with a sentinel where the
documents go; that only works for a template whose conversation starts like
its one-turn chat and ends like it (true of the usual ones), which is checked here.
"""

from __future__ import annotations

from blendkv.entrypoints.openai.errors import APIError
from blendkv.entrypoints.openai.protocol import ChatMessage

SYSTEM_ROLES = ("system", "developer")
_SENTINEL = "\u2063BLENDKV_DOCUMENTS\u2063"


def _error(message: str) -> APIError:
    return APIError(400, message, param="messages")


def split_blended_chat(messages: list[ChatMessage], tokenizer) -> tuple[str | None, str, str]:
    """``(system, question, query)`` of a chat with documents: the leading system messages
    joined, the last user message (what retrieval searches for) and the text that follows the
    documents (the question alone for a one-turn chat, else the rendered turns)."""
    n_system = 0
    while n_system < len(messages) and messages[n_system].role in SYSTEM_ROLES:
        n_system += 1
    systems, turns = messages[:n_system], messages[n_system:]
    system = "\n\n".join(m.text() for m in systems) if systems else None
    if not turns or turns[-1].role != "user":
        raise _error("a chat with documents (or rag) must end with a user message")
    question = turns[-1].text()
    if len(turns) == 1:
        return system, question, question
    if turns[0].role != "user":
        raise _error(
            "in a conversation with documents (or rag) the first message after the system "
            f"messages must be a user message (the documents go there), got {turns[0].role!r}"
        )
    return system, question, _rendered_turns(system, turns, tokenizer)


def _rendered_turns(system: str | None, turns: list[ChatMessage], tokenizer) -> str:
    """The conversation's text after the documents, less the one-turn template's suffix (the
    blended prompt appends that suffix itself)."""
    import jinja2

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise _error("this model has no chat template: documents take a one-turn chat")
    head = [{"role": "system", "content": system}] if system is not None else []
    first = {"role": "user", "content": _SENTINEL + turns[0].text()}
    rest = [{"role": m.role, "content": m.text()} for m in turns[1:]]
    try:
        one_turn = _render(tokenizer, [*head, {"role": "user", "content": _SENTINEL}])
        whole = _render(tokenizer, [*head, first, *rest])
    except jinja2.TemplateError as exc:  # e.g. roles that do not alternate
        raise _error(f"the chat template refused the messages: {exc}") from exc
    before_1, _, suffix = one_turn.partition(_SENTINEL)
    before, sep, after = whole.partition(_SENTINEL)
    if not sep or before != before_1 or not after.endswith(suffix):
        raise _error(
            "this model's chat template renders a conversation differently from a one-turn "
            "chat, so documents cannot be blended into it; send one user message"
        )
    return after[: len(after) - len(suffix)]


def _render(tokenizer, messages: list[dict]) -> str:
    # As the blended prompt's own template pieces: a template without a system role gets the
    # system text folded into the first user turn.
    from blendkv.connector.prompt import apply_template

    return apply_template(tokenizer, messages, tokenize=False, add_generation_prompt=True)
