"""OpenAI requests -> engine requests (responses: :mod:`.responses`).

Validation lives where it already is: the request models check types (:mod:`.protocol`),
``SamplingParams`` and ``BlendConfig`` check ranges, ``LLMEngine.prepare_request`` checks prompts
(on AsyncLLM's prepare thread), size limits come first (:mod:`.request_limits`). Here only what
the OpenAI API adds is checked: unsupported features (``n > 1``, tools, ...), ``logit_bias`` keys
(token ids as strings), the model name, the shape of a blended chat and ``blend`` options that
cannot apply (a layer the model does not have, a field the config ignores). All of it runs
before the request is queued.

A chat request with ``documents`` (or ``rag``) becomes the engine's blended prompt::

    system messages  ─▶ "system"      (joined; None when there is none)
    documents[i]     ─▶ "documents"   ("title\\ntext" when a title is given)
    last user turn   ─▶ "query"       (a conversation: its turns, see :mod:`.conversation`)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blendkv.blend.config import BlendConfig
from blendkv.entrypoints.async_llm import AsyncLLM, RequestStream
from blendkv.entrypoints.openai.conversation import split_blended_chat
from blendkv.entrypoints.openai.errors import APIError, api_error
from blendkv.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from blendkv.entrypoints.openai.structured import check_prompt_logprobs, structured_outputs
from blendkv.errors import InvalidRequestError
from blendkv.rag.chunk_order import ChunkOrderError, check_chunk_order
from blendkv.sampling_params import SamplingParams


@dataclass
class Served:
    """What the routes need once the model is loaded."""

    engine: AsyncLLM
    model_name: str
    max_model_len: int
    rag: Any = None  # a RAGPipeline over the engine's LLM (``--store``), or None
    # token id -> (its string, its bytes) in logprobs (engine.detokenizer.logprob_token)
    logprob_token: Callable[[int], tuple[str, bytes]] = lambda t: (str(t), str(t).encode())
    vocab_size: int | None = None
    num_layers: int | None = None  # of the model (blend layers must be below it)
    # The HTTP side's own tokenizer (the engine thread uses the engine's): chat templates of
    # conversations with documents are rendered with it, as text.
    tokenizer: Any = None
    replica_name: str | None = None  # among replicas: this one's (blend stats say it)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )


# ------------------------------------------------------------------------- requests
def sampling_params(
    req: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    param_names: dict[str, str] | None = None,
    vocab_size: int | None = None,
) -> SamplingParams:
    refuse_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")
    if vocab_size is not None and req.stop_token_ids:
        bad = [t for t in req.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                400,
                f"stop_token_ids {bad[:5]} are out of vocabulary [0, {vocab_size})",
                param="stop_token_ids",
            )
    blended = getattr(req, "documents", None) is not None or getattr(req, "rag", None) is not None
    check_prompt_logprobs(req, blended)
    constraint = structured_outputs(req)
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias(req.logit_bias),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            n=1 if req.n is None else req.n,
            structured_outputs=constraint,
            prompt_logprobs=req.prompt_logprobs,
        )
    except InvalidRequestError as exc:
        raise api_error(exc, param_names) from exc


def refuse_unsupported(req: SamplingRequest) -> None:
    """A 400 naming the first field of a feature blendkv does not have (docs/guide/requests.md
    lists them)."""
    for name in req.UNSUPPORTED:
        if getattr(req, name) not in (None, False):
            raise APIError(400, f"{name} is not supported by blendkv", param=name)
    if getattr(req, "tool_choice", None) not in (None, "none"):
        raise APIError(400, "tool_choice is not supported (no tools)", param="tool_choice")


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with int keys."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(
                400,
                f"logit_bias keys must be token ids (integers), got {key!r}",
                param="logit_bias",
            ) from None
    return out


EMPTY_PROMPT = "The decoder prompt cannot be empty"  # vLLM's words


def completion_prompt(req: CompletionRequest, vocab_size: int | None = None) -> str | list[int]:
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError(400, "best_of must be 1", param="best_of")
    for name in ("documents", "blend", "rag", "token_map"):
        if getattr(req, name) not in (None, False):
            raise APIError(400, f"{name} is a chat field: use /v1/chat/completions", param=name)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(
                400,
                f"one prompt per request, got {len(prompt)}; send them separately",
                param="prompt",
            )
        prompt = prompt[0]
    if len(prompt) == 0:
        raise APIError(400, EMPTY_PROMPT, param="prompt")
    if isinstance(prompt, list) and vocab_size is not None:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                400,
                f"token ids {bad[:5]} are out of vocabulary [0, {vocab_size})",
                param="prompt",
            )
    return prompt


def chat_max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    """``(max_tokens, the field it came in)``: ``max_completion_tokens`` wins when both are set."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def chat_params(req: ChatCompletionRequest, vocab_size: int | None = None) -> SamplingParams:
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    names = {"logprobs": "top_logprobs"}  # engine parameter -> API field, for errors' param
    max_tokens, names["max_tokens"] = chat_max_tokens(req)
    return sampling_params(req, max_tokens, logprobs, names, vocab_size)


def chat_prompt(req: ChatCompletionRequest, served: Served) -> tuple[Callable, dict]:
    """``(prompt factory for the prepare thread, add_request keyword arguments)``."""
    for m in req.messages:
        if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
            raise APIError(400, "only text content parts are supported", param="messages")
    blended = req.documents is not None or req.rag is not None
    if not blended:
        if req.blend is not None:
            raise APIError(400, "blend options need documents (or rag)", param="blend")
        if req.token_map:
            raise APIError(
                400,
                "token_map needs documents (or rag): every token of a plain chat is computed",
                param="token_map",
            )
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        return lambda stream: render_chat(served, messages), {}
    if req.documents is not None and req.rag is not None:
        raise APIError(400, "give documents or rag, not both", param="rag")
    system, question, query = split_blended_chat(req.messages, served.tokenizer)
    kwargs = {"blend": blend_config(req, served.num_layers), "token_map": req.token_map}
    if req.documents is not None:
        docs = [f"{d.title}\n{d.text}" if d.title else d.text for d in req.documents]
        prompt = {"documents": docs, "query": query, "system": system}
        return lambda stream: prompt, kwargs
    if served.rag is None:
        raise APIError(400, "rag needs a server started with --store DIR", param="rag")
    top_k, doc_filter, rag = req.rag.top_k, req.rag.filter, served.rag
    order = req.rag.chunk_order
    if order is not None:
        try:
            check_chunk_order(order)
        except ChunkOrderError as exc:
            raise APIError(400, str(exc), param="rag.chunk_order") from exc

    def retrieve(stream: RequestStream) -> dict:  # runs on the prepare thread
        sources = rag.order_sources(rag.retrieve(question, top_k, doc_filter), order)
        stream.extra["sources"] = [s.to_dict() for s in sources]
        prompt = rag.blended_prompt(question, sources, system)
        if query != question:  # a conversation: its turns follow the retrieved chunks
            prompt["query"] = query
        return prompt

    return retrieve, kwargs


def render_chat(served: Served, messages: list[dict]) -> list[int]:
    import jinja2

    try:
        return served.engine.llm.render_chat(messages)
    except jinja2.TemplateError as exc:  # e.g. roles that do not alternate, or a role it lacks
        raise APIError(
            400, f"the chat template refused the messages: {exc}", param="messages"
        ) from exc
    except ValueError as exc:  # transformers: the tokenizer has no chat template
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(f"this model cannot chat: {exc}; use /v1/completions") from exc


def blend_config(req: ChatCompletionRequest, num_layers: int | None = None) -> BlendConfig | None:
    """The request's own ``BlendConfig``; None when it set no blend field (the engine's default,
    which its cost check may run as full prefill: :mod:`blendkv.guards.cost_check`).

    Refused (400, ``param`` "blend", the message naming the field): a value ``BlendConfig``
    refuses, a layer the model (``num_layers``) does not have, and a field set to other than its
    default that the config does not use (``check_layer`` with ``selection: "prophet"``, ...,
    :meth:`BlendConfig.unused_fields`): it would silently change nothing."""
    fields = req.blend.model_dump(exclude_none=True) if req.blend is not None else {}
    if not fields:
        return None
    try:
        config = BlendConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"blend: {exc}", param="blend") from exc
    if num_layers is not None:
        layer = fields.get("check_layer")
        if layer is not None and layer >= num_layers:
            raise APIError(
                400,
                f"blend.check_layer {layer} is out of range: the model has {num_layers} layers "
                f"(0 to {num_layers - 1})",
                param="blend",
            )
        try:
            config.validate_for(num_layers)
        except ValueError as exc:
            raise APIError(400, f"blend: {exc}", param="blend") from exc
    defaults = BlendConfig()
    for name, why in config.unused_fields().items():
        if name in fields and getattr(config, name) != getattr(defaults, name):
            raise APIError(400, f"blend.{name} does not apply: {why}; leave it out", param="blend")
    return config
