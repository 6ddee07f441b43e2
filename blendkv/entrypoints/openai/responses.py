"""``RequestOutput``s -> OpenAI responses: whole bodies, usage, logprobs and SSE streams."""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from blendkv.entrypoints.async_llm import RequestStream
from blendkv.entrypoints.openai.errors import api_error
from blendkv.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from blendkv.entrypoints.openai.serving import Served
from blendkv.outputs import RequestOutput


def usage(out: RequestOutput) -> Usage:
    """The prompt counted once, every choice's completion tokens (OpenAI's ``n``)."""
    n_in = len(out.prompt_token_ids)
    n_out = sum(len(comp.token_ids) for comp in out.outputs)
    return Usage(
        prompt_tokens=n_in,
        completion_tokens=n_out,
        total_tokens=n_in + n_out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.metrics.num_cached_tokens),
    )


def blend_info(out: RequestOutput | None, stream: RequestStream, served: Served) -> dict | None:
    """The ``blendkv`` extension field: blend stats, retrieved sources and, when asked for,
    the token map (with each prompt token's id and text), or None."""
    if out is None or out.blend_stats is None:
        return None
    info = out.blend_stats.to_dict()
    if served.replica_name is not None:
        info["replica"] = served.replica_name
    if "sources" in stream.extra:
        info["sources"] = stream.extra["sources"]
    token_map = out.blend_stats.token_map
    if token_map is not None:
        ids = list(out.prompt_token_ids)
        info["token_map"] = {
            **token_map.to_dict(),
            "token_ids": ids,
            "tokens": token_texts(served, ids),
        }
    return info


def token_texts(served: Served, ids: list[int]) -> list[str]:
    """Each token's text such that they join to the prompt's text: a character split over
    several tokens (an emoji's four bytes) shows on the token that completes it."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    texts = [decoder.decode(served.logprob_token(t)[1]) for t in ids]
    if texts:
        texts[-1] += decoder.decode(b"", final=True)
    return texts


def blend_headers(out: RequestOutput) -> dict[str, str]:
    """``x-blendkv-*`` headers: the blend stats' numbers, for clients that drop unknown fields."""
    if out.blend_stats is None:
        return {}
    return {
        "x-blendkv-" + k.replace("_", "-"): str(v)
        for k, v in out.blend_stats.to_dict().items()
        if isinstance(v, (int, float))
    }


_MIN_LOGPROB = -9999.0  # OpenAI's floor: JSON has no -inf


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _ranked(entry: dict[int, float], top_n: int) -> list[tuple[int, float]]:
    # The engine gives the sampled token first, then the top-n it did not cover.
    return sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]


def token_namer(served: Served, as_ids: bool) -> Callable[[int], tuple[str, bytes]]:
    """token id -> (its string in logprobs, its bytes); ``as_ids``: vLLM's
    ``return_tokens_as_token_ids`` (the string is ``token_id:<id>``)."""
    if not as_ids:
        return served.logprob_token
    return lambda t: (f"token_id:{t}", served.logprob_token(t)[1])


def chat_logprobs(
    entries: list[dict[int, float]], top_n: int, token: Callable[[int], tuple[str, bytes]]
) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token its string, real bytes and the ``top_n`` most likely
    tokens (sorted; the sampled one appears there only if it is among them, as in OpenAI)."""
    content = []
    for entry in entries:
        tid, lp = next(iter(entry.items()))
        top = []
        for t, v in _ranked(entry, top_n):
            text, raw = token(t)
            top.append(TopLogprob(token=text, logprob=_lp(v), bytes=list(raw)))
        text, raw = token(tid)
        content.append(TokenLogprob(token=text, logprob=_lp(lp), bytes=list(raw), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(
    entries: list[dict[int, float]],
    token: Callable[[int], tuple[str, bytes]],
    offset: int = 0,
) -> CompletionLogprobs:
    """Legacy completions' logprobs as vLLM gives them: each ``top_logprobs`` dict holds the
    sampled token and the ``logprobs`` most likely ones (so ``logprobs`` or ``logprobs + 1``
    entries; ``logprobs=0``: the sampled token alone). Its keys are token strings; a token
    whose string another token of the same dict already uses is keyed ``token_id:<id>``, so
    distinct tokens are never merged into one key."""
    lp = CompletionLogprobs()
    for entry in entries:
        tid, value = next(iter(entry.items()))
        text, raw = token(tid)
        lp.tokens.append(text)
        lp.token_logprobs.append(_lp(value))
        top: dict[str, float] = {}
        for t, v in entry.items():  # the sampled token first, as the engine gives it
            key = token(t)[0]
            top[f"token_id:{t}" if key in top else key] = _lp(v)
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(raw.decode("utf-8", "ignore"))  # part of a character: no text yet
    return lp


@dataclass(frozen=True)
class ReplyOptions:
    """How one request's answer is shaped (from its request body)."""

    rid: str
    top_n: int = 0  # chat: top_logprobs (completions return the engine's whole entry)
    as_ids: bool = False  # return_tokens_as_token_ids
    include_usage: bool = False  # streams: a final usage chunk
    continuous_usage: bool = False  # streams: usage in every chunk too (vLLM)
    n: int = 1
    created: int = field(default_factory=lambda: int(time.time()))


def prompt_logprobs(out: RequestOutput, served: Served) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {logprob,
    rank, decoded_token}}``; rank counts from 1 within the entry's top tokens (the prompt token
    outside them has the rank after the last of them: at least that)."""
    if out.prompt_logprobs is None:
        return None
    result: list = []
    for entry in out.prompt_logprobs:
        if entry is None:
            result.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        result.append(
            {
                str(t): {"logprob": _lp(v), "rank": r, "decoded_token": served.logprob_token(t)[0]}
                for r, (t, v) in enumerate(ranked, start=1)
            }
        )
    return result


def _choice_logprobs(comp, sent: int, opts: ReplyOptions, served: Served, chat: bool, offset=0):
    if comp.logprobs is None or len(comp.logprobs) <= sent:
        return None
    new, token = comp.logprobs[sent:], token_namer(served, opts.as_ids)
    if chat:
        return chat_logprobs(new, opts.top_n, token)
    return completion_logprobs(new, token, offset)


def chat_response(
    served: Served, out: RequestOutput, stream: RequestStream, opts: ReplyOptions
) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=comp.index,
            message=ResponseMessage(content=comp.text),
            logprobs=_choice_logprobs(comp, 0, opts, served, chat=True),
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
        )
        for comp in out.outputs
    ]
    return ChatCompletionResponse(
        id=opts.rid,
        created=opts.created,
        model=served.model_name,
        choices=choices,
        usage=usage(out),
        prompt_logprobs=prompt_logprobs(out, served),
        blendkv=blend_info(out, stream, served),
    )


def completion_response(
    served: Served, out: RequestOutput, opts: ReplyOptions
) -> CompletionResponse:
    choices = [
        CompletionChoice(
            index=comp.index,
            text=comp.text,
            prompt_logprobs=prompt_logprobs(out, served),
            logprobs=_choice_logprobs(comp, 0, opts, served, chat=False),
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
        )
        for comp in out.outputs
    ]
    return CompletionResponse(
        id=opts.rid,
        created=opts.created,
        model=served.model_name,
        choices=choices,
        usage=usage(out),
        blendkv=None,
    )


def sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


def _so_far(out: RequestOutput | None) -> Usage:
    """Continuous usage: the prompt and the tokens generated so far (0 before the first)."""
    n_in = 0 if out is None else len(out.prompt_token_ids)
    n_out = 0 if out is None else sum(len(c.token_ids) for c in out.outputs)
    return Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)


async def chat_stream(
    served: Served, stream: RequestStream, opts: ReplyOptions
) -> AsyncIterator[str]:
    """Server-sent events of a chat completion (``opts.n`` choices); closing it early aborts
    the request. A choice's last text and its ``finish_reason`` share one chunk (vLLM's
    clients read the text there); a choice that ends before the others gets it when it ends.
    With continuous usage the role chunk waits for the first output (it needs the prompt's
    token count)."""

    def chunk(choices, out, **kw) -> str:
        if opts.continuous_usage and "usage" not in kw:
            kw["usage"] = _so_far(out)
        return sse(
            ChatCompletionChunk(
                id=opts.rid, created=opts.created, model=served.model_name, choices=choices, **kw
            )
        )

    try:
        if not opts.continuous_usage:
            yield chunk(_role_choices(opts.n), None)
        last, sent, ended = None, {}, set()  # per choice index: logprobs sent; finish sent
        async for out in stream:
            if last is None and opts.continuous_usage:
                yield chunk(_role_choices(opts.n), None, usage=_prompt_only(out))
            last, pieces = out, []
            for comp in out.outputs:
                i = comp.index
                logprobs = _choice_logprobs(comp, sent.get(i, 0), opts, served, chat=True)
                if comp.logprobs is not None:
                    sent[i] = len(comp.logprobs)
                finish = comp.finish_reason if i not in ended else None
                if comp.delta_text or logprobs is not None or finish is not None:
                    if finish is not None:
                        ended.add(i)
                    choice = ChatChunkChoice(
                        index=i,
                        delta=DeltaMessage(content=comp.delta_text),
                        logprobs=logprobs,
                        finish_reason=finish,
                        stop_reason=comp.stop_reason if finish is not None else None,
                    )
                    pieces.append(choice)
            for k, choice in enumerate(pieces):
                extra = {}
                if out.finished and k == len(pieces) - 1:
                    extra["blendkv"] = blend_info(out, stream, served)
                yield chunk([choice], out, **extra)
            if out.finished and not pieces:
                yield chunk([], out, blendkv=blend_info(out, stream, served))
        if opts.include_usage:
            yield chunk([], last, usage=usage(last))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # after the 200 header: the error goes into the stream
        yield sse(api_error(exc).body())
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


def _role_choices(n: int) -> list[ChatChunkChoice]:
    return [
        ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(n)
    ]


def _prompt_only(out: RequestOutput) -> Usage:
    n_in = len(out.prompt_token_ids)
    return Usage(prompt_tokens=n_in, completion_tokens=0, total_tokens=n_in)


async def completion_stream(
    served: Served, stream: RequestStream, opts: ReplyOptions
) -> AsyncIterator[str]:
    def chunk(choices, out, **kw) -> str:
        if opts.continuous_usage and "usage" not in kw:
            kw["usage"] = _so_far(out)
        return sse(
            CompletionResponse(
                id=opts.rid, created=opts.created, model=served.model_name, choices=choices, **kw
            )
        )

    try:
        last, sent, offset, ended = None, {}, {}, set()  # per choice index
        async for out in stream:
            last = out
            for comp in out.outputs:
                i = comp.index
                logprobs = _choice_logprobs(
                    comp, sent.get(i, 0), opts, served, chat=False, offset=offset.get(i, 0)
                )
                if logprobs is not None:
                    sent[i] = len(comp.logprobs)
                    offset[i] = offset.get(i, 0) + len(comp.delta_text)
                finish = comp.finish_reason if i not in ended else None
                if comp.delta_text or logprobs is not None or finish is not None:
                    if finish is not None:
                        ended.add(i)
                    choice = CompletionChoice(
                        index=i,
                        text=comp.delta_text,
                        logprobs=logprobs,
                        finish_reason=finish,
                        stop_reason=comp.stop_reason if finish is not None else None,
                    )
                    yield chunk([choice], out)
        if opts.include_usage:
            yield chunk([], last, usage=usage(last))
        yield "data: [DONE]\n\n"
    except Exception as exc:
        yield sse(api_error(exc).body())
        yield "data: [DONE]\n\n"
    finally:
        stream.close()
