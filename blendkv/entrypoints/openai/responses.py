"""``RequestOutput``s -> OpenAI responses: whole bodies, usage, logprobs and SSE streams."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
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


def blend_info(out: RequestOutput | None, stream: RequestStream) -> dict | None:
    """The ``blendkv`` extension field: blend stats (and retrieved sources), or None."""
    if out is None or out.blend_stats is None:
        return None
    info = out.blend_stats.to_dict()
    if "sources" in stream.extra:
        info["sources"] = stream.extra["sources"]
    return info


def blend_headers(out: RequestOutput) -> dict[str, str]:
    """``x-blendkv-*`` headers: the blend stats' numbers, for clients that drop unknown fields."""
    if out.blend_stats is None:
        return {}
    return {
        "x-blendkv-" + k.replace("_", "-"): str(v)
        for k, v in out.blend_stats.to_dict().items()
        if isinstance(v, (int, float))
    }


def _ranked(entry: dict[int, float], top_n: int) -> list[tuple[int, float]]:
    # The engine gives the sampled token first, then the top-n it did not cover.
    return sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]


def chat_logprobs(entries: list[dict[int, float]], top_n: int, text: Callable) -> ChatLogprobs:
    content = []
    for entry in entries:
        tid, lp = next(iter(entry.items()))
        top = [
            TopLogprob(token=text(t), logprob=v, bytes=list(text(t).encode()))
            for t, v in _ranked(entry, top_n)
        ]
        s = text(tid)
        content.append(TokenLogprob(token=s, logprob=lp, bytes=list(s.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(
    entries: list[dict[int, float]], top_n: int, text: Callable, offset: int = 0
) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    for entry in entries:
        tid, value = next(iter(entry.items()))
        s = text(tid)
        lp.tokens.append(s)
        lp.token_logprobs.append(value)
        lp.top_logprobs.append({text(t): v for t, v in _ranked(entry, top_n)})
        lp.text_offset.append(offset)
        offset += len(s)
    return lp


def chat_response(
    rid: str, served: Served, out: RequestOutput, stream: RequestStream, top_n: int
) -> ChatCompletionResponse:
    choices = []
    for comp in out.outputs:
        logprobs = None
        if comp.logprobs is not None:
            logprobs = chat_logprobs(comp.logprobs, top_n, served.token_text)
        choices.append(
            ChatChoice(
                index=comp.index,
                message=ResponseMessage(content=comp.text),
                logprobs=logprobs,
                finish_reason=comp.finish_reason,
            )
        )
    return ChatCompletionResponse(
        id=rid,
        model=served.model_name,
        choices=choices,
        usage=usage(out),
        blendkv=blend_info(out, stream),
    )


def completion_response(
    rid: str, served: Served, out: RequestOutput, top_n: int
) -> CompletionResponse:
    choices = []
    for comp in out.outputs:
        logprobs = None
        if comp.logprobs is not None:
            logprobs = completion_logprobs(comp.logprobs, top_n, served.token_text)
        choices.append(
            CompletionChoice(
                index=comp.index,
                text=comp.text,
                logprobs=logprobs,
                finish_reason=comp.finish_reason,
            )
        )
    return CompletionResponse(
        id=rid, model=served.model_name, choices=choices, usage=usage(out), blendkv=None
    )


def sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


async def chat_stream(
    rid: str,
    created: int,
    served: Served,
    stream: RequestStream,
    top_n: int,
    include_usage: bool,
    n: int = 1,
) -> AsyncIterator[str]:
    """Server-sent events of a chat completion (``n`` choices); closing it early aborts the
    request. A choice that ends before the others gets its finish chunk when it ends."""

    def chunk(choices, **kw) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=rid, created=created, model=served.model_name, choices=choices, **kw
        )

    try:
        roles = [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(n)
        ]
        yield sse(chunk(roles))
        last, sent, ended = None, {}, set()  # per choice index: logprobs sent; finish sent
        async for out in stream:
            last = out
            for comp in out.outputs:
                i, logprobs = comp.index, None
                if comp.logprobs is not None and len(comp.logprobs) > sent.get(i, 0):
                    new = comp.logprobs[sent.get(i, 0) :]
                    logprobs = chat_logprobs(new, top_n, served.token_text)
                    sent[i] = len(comp.logprobs)
                if comp.delta_text or logprobs is not None:
                    delta = DeltaMessage(content=comp.delta_text)
                    yield sse(chunk([ChatChunkChoice(index=i, delta=delta, logprobs=logprobs)]))
                if comp.finish_reason is not None and not out.finished and i not in ended:
                    ended.add(i)  # a choice that ends before the others
                    end = ChatChunkChoice(
                        index=i, delta=DeltaMessage(), finish_reason=comp.finish_reason
                    )
                    yield sse(chunk([end]))
        ends = [
            ChatChunkChoice(index=c.index, delta=DeltaMessage(), finish_reason=c.finish_reason)
            for c in last.outputs
            if c.index not in ended
        ]
        yield sse(chunk(ends, blendkv=blend_info(last, stream)))
        if include_usage:
            yield sse(chunk([], usage=usage(last)))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # after the 200 header: the error goes into the stream
        yield sse(api_error(exc).body())
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


async def completion_stream(
    rid: str,
    created: int,
    served: Served,
    stream: RequestStream,
    top_n: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(choices, **kw) -> CompletionResponse:
        return CompletionResponse(
            id=rid, created=created, model=served.model_name, choices=choices, **kw
        )

    try:
        last, sent, offset, ended = None, {}, {}, set()  # per choice index
        async for out in stream:
            last = out
            for comp in out.outputs:
                i, logprobs = comp.index, None
                if comp.logprobs is not None and len(comp.logprobs) > sent.get(i, 0):
                    new = comp.logprobs[sent.get(i, 0) :]
                    logprobs = completion_logprobs(new, top_n, served.token_text, offset.get(i, 0))
                    sent[i] = len(comp.logprobs)
                    offset[i] = offset.get(i, 0) + sum(map(len, logprobs.tokens))
                newly_ended = comp.finish_reason is not None and i not in ended
                if comp.delta_text or logprobs is not None or newly_ended:
                    if newly_ended:
                        ended.add(i)
                    choice = CompletionChoice(
                        index=i,
                        text=comp.delta_text,
                        logprobs=logprobs,
                        finish_reason=comp.finish_reason,
                    )
                    yield sse(chunk([choice]))
        if include_usage:
            yield sse(chunk([], usage=usage(last)))
        yield "data: [DONE]\n\n"
    except Exception as exc:
        yield sse(api_error(exc).body())
        yield "data: [DONE]\n\n"
    finally:
        stream.close()
