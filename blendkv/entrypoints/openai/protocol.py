"""Request and response bodies of the OpenAI-compatible API (pydantic models).

The OpenAI fields blendkv serves, vLLM's sampling extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ...) and blendkv's
own: ``documents`` (vLLM's chat field), ``blend`` (a :class:`~blendkv.blend.config.BlendConfig`),
``rag`` (retrieve from the server's store), ``token_map`` (how each prompt token was computed),
and ``blendkv`` in responses (the blend stats, the sources, the token map).
Types are strict, as OpenAI's and vLLM's: an integer given as a string, a boolean or a float
(``"10"``, ``true``, ``10.5``), a boolean given as anything else (``"yes"``, ``1``) and a number
given as a string are refused (a 400 naming the field), never converted; a JSON integer is a
valid float. Chat roles are OpenAI's (``system``, ``developer``, ``user``, ``assistant``,
``tool``). ``temperature`` is in [0, 2] and ``top_p`` in (0, 1] (vLLM's ranges); other ranges
are checked by the engine's own validation (``SamplingParams``, ``BlendConfig``), and
``max_tokens`` against the context by :mod:`.request_limits`. Unknown request fields are
ignored, as OpenAI-compatible servers do.

Every string of a request body (values and object keys, at any depth) is cleaned once, before
validation: lone surrogates (which JSON's ``\\ud800`` escapes can produce and no tokenizer or
UTF-8 encoder accepts) become U+FFFD, as in :mod:`blendkv.text`.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
    model_validator,
)

from blendkv.text import replace_lone_surrogates

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's seed range (a torch.long)
# OpenAI's chat roles ("function" is deprecated and needs tools, which blendkv refuses).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class OpenAIModel(BaseModel):
    """Ignores unknown request fields; drops the fields in ``_omit_if_none`` when None."""

    model_config = ConfigDict(extra="ignore")
    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class StrictModel(OpenAIModel):
    """blendkv's extension objects: a misspelt field is an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- requests
def clean_strings(value: Any, where: str = "request") -> Any:
    """``value`` (parsed JSON) with lone surrogates in every string and key replaced."""
    if isinstance(value, str):
        return replace_lone_surrogates(value, where)
    if isinstance(value, list):
        return [clean_strings(v, where) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            k = clean_strings(k, where)
            out[k] = clean_strings(v, f"{where}.{k[:40]}" if isinstance(k, str) else where)
        return out
    return value


class StreamOptions(OpenAIModel):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # vLLM: usage in every chunk


class SamplingRequest(OpenAIModel):
    """Fields completions and chat share."""

    @model_validator(mode="before")
    @classmethod
    def _clean_text(cls, data: Any) -> Any:
        return clean_strings(data)

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False  # vLLM: logprob tokens as "token_id:<id>"
    # vLLM's prompt logprobs and structured outputs (openai.structured checks them).
    prompt_logprobs: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    # OpenAI / vLLM features blendkv does not have: a value other than None / False is refused
    # with a 400 naming the field (serving.refuse_unsupported), never silently ignored.
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    guided_grammar: Any = None
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "truncate_prompt_tokens",
        "use_beam_search",
        "guided_grammar",
    )


class CompletionRequest(SamplingRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: str | None = None
    # Chat-only blendkv fields: refused here rather than silently ignored.
    documents: Any = None
    blend: Any = None
    rag: Any = None
    token_map: Any = None


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class Document(OpenAIModel):
    """One document of a chat request (vLLM's ``documents`` field)."""

    text: str
    title: str | None = None


class BlendOptions(StrictModel):
    """Fields of :class:`~blendkv.blend.config.BlendConfig`; unset fields keep its defaults."""

    recompute_ratio: StrictFloat | Literal["auto"] | None = None
    min_recompute_ratio: StrictFloat | None = None
    max_recompute_ratio: StrictFloat | None = None
    check_layer: StrictInt | None = None
    selection: str | None = None
    schedule: list[tuple[StrictInt, StrictFloat]] | None = None
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    correction: str | None = None
    correction_shrink: StrictFloat | None = None
    correction_prior: str | None = None
    chunk_head_tokens: StrictInt | None = None
    chunk_samples: StrictInt | None = None
    reselect: StrictInt | None = None
    skip_exact: StrictBool | None = None
    fidelity_target: StrictFloat | None = None


class RAGOptions(StrictModel):
    """Retrieve ``top_k`` chunks for the last user message from the server's ``--store``;
    ``filter`` (e.g. ``{"source": "docs/a.md"}``) retrieves only from the documents whose
    ``source``, ``doc_id`` or metadata values it names (a list: any of them); ``chunk_order``
    (``relevance_last``, ``relevance_first``, ``source``) overrides the store's prompt order."""

    top_k: StrictInt = Field(4, ge=1)
    filter: dict[str, Any] | None = None
    chunk_order: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    documents: list[Document] | None = None
    blend: BlendOptions | None = None
    rag: RAGOptions | None = None
    # with documents or rag: blendkv.token_map in the response (blendkv.blend.token_map)
    token_map: StrictBool = False
    tool_choice: Any = None  # only "none" (tools are refused)
    echo: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        *SamplingRequest.UNSUPPORTED,
        "echo",
        "continue_final_message",
        "chat_template",
    )


# -------------------------------------------------------------------------- responses
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "blendkv"
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class Usage(OpenAIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int = 0
    text: str
    # vLLM's: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or token id


class CompletionResponse(OpenAIModel):
    _omit_if_none = ("usage", "blendkv")
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    blendkv: dict[str, Any] | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class ResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(OpenAIModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or token id


class ChatCompletionResponse(OpenAIModel):
    _omit_if_none = ("blendkv",)
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # as CompletionChoice's
    blendkv: dict[str, Any] | None = None


class DeltaMessage(OpenAIModel):
    _omit_if_none = ("role", "content")
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(OpenAIModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or token id


class ChatCompletionChunk(OpenAIModel):
    _omit_if_none = ("usage", "blendkv")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    blendkv: dict[str, Any] | None = None
