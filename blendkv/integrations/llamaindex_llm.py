"""A blendkv :class:`~blendkv.LLM` as a LlamaIndex LLM: complete and chat, plain, streamed, async.

    Settings.llm = BlendKVLLM(LLM(), max_tokens=256)
    BlendKVLLM(llm).complete("The capital of France is").text

For LlamaIndex components that need an LLM (response synthesizers, agents, chat engines). It
gets a flat prompt (LlamaIndex formats retrieved nodes into the text), so it cannot reuse stored
chunk K/V: for answers from the store's K/V use
:class:`~blendkv.integrations.llamaindex.BlendKVQueryEngine`. Chat messages go through the
model's chat template when it has one. Greedy (temperature 0) by default.

Thread-safe, as the ``LLM`` is; the async methods run the call on a worker thread, so an
``asyncio.gather`` of them is batched in the one engine loop. Needs
``pip install llama-index-core``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from blendkv.sampling_params import SamplingParams

_END = object()
_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class BlendKVLLM(CustomLLM):
    """Wraps a blendkv ``LLM`` (``llm``) as a LlamaIndex ``CustomLLM``.

    Per-call keywords that are ``SamplingParams`` fields (``complete(p, max_tokens=8)``)
    override the defaults for that call; other keywords are ignored.

    Attributes:
        max_tokens: output tokens at most (default 256).
        temperature: 0 (the default) is greedy.
        sampling_params: a blendkv :class:`~blendkv.SamplingParams` that replaces the
            ``max_tokens`` and ``temperature`` defaults.
    """

    max_tokens: int = Field(default=256, description="Output tokens at most.")
    temperature: float = Field(default=0.0, description="0 is greedy.")
    sampling_params: Any = Field(default=None, description="A blendkv SamplingParams.")
    _llm: Any = PrivateAttr()

    def __init__(self, llm, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._llm = llm

    @classmethod
    def class_name(cls) -> str:
        """LlamaIndex's name of this class: ``"blendkv_llm"``."""
        return "blendkv_llm"

    @property
    def metadata(self) -> LLMMetadata:
        """The context window, output length, chat-ness and name LlamaIndex plans with."""
        info = self._llm.engine.info
        return LLMMetadata(
            context_window=info.max_model_len,
            num_output=self._params({}).max_tokens or info.max_model_len,
            is_chat_model=self._has_chat_template(),
            model_name=info.model_name,
        )

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt`` (``raw``: the blendkv ``RequestOutput``)."""
        [out] = self._llm.generate([self._format(prompt, formatted)], self._params(kwargs))
        return CompletionResponse(text=out.text, raw=out)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Complete ``prompt``, a response per step (``delta``: the new text)."""
        stream = self._llm.stream(self._format(prompt, formatted), self._params(kwargs))
        return (CompletionResponse(text=t, delta=d, raw=o) for t, d, o in _texts(stream))

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        """:meth:`complete` on a worker thread."""
        return await asyncio.to_thread(self.complete, prompt, formatted, **kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """:meth:`stream_complete` from a worker thread."""
        gen = await asyncio.to_thread(self.stream_complete, prompt, formatted, **kwargs)
        return _in_thread(gen)

    # ------------------------------------------------------------------------ chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer the conversation (through the model's chat template when it has one)."""
        [out] = self._llm.generate([self._chat_prompt(messages)], self._params(kwargs))
        return ChatResponse(message=_assistant(out.text), raw=out)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Answer the conversation, a response per step (``delta``: the new text)."""
        stream = self._llm.stream(self._chat_prompt(messages), self._params(kwargs))
        return (ChatResponse(message=_assistant(t), delta=d, raw=o) for t, d, o in _texts(stream))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """:meth:`chat` on a worker thread."""
        return await asyncio.to_thread(self.chat, messages, **kwargs)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        """:meth:`stream_chat` from a worker thread."""
        gen = await asyncio.to_thread(self.stream_chat, messages, **kwargs)
        return _in_thread(gen)

    # --------------------------------------------------------------------- helpers
    def _params(self, overrides: dict[str, Any]) -> SamplingParams:
        base = self.sampling_params or SamplingParams(
            temperature=self.temperature, max_tokens=self.max_tokens
        )
        changes = {k: v for k, v in overrides.items() if k in _PARAM_NAMES}
        return dataclasses.replace(base, **changes) if changes else base

    def _format(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    def _has_chat_template(self) -> bool:
        return bool(getattr(self._llm.tokenizer, "chat_template", None))

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> str | list[int]:
        """Token ids from the model's chat template, or LlamaIndex's generic rendering."""
        if not self._has_chat_template():
            return self.messages_to_prompt(messages)
        turns = [{"role": m.role.value, "content": m.content or ""} for m in messages]
        if self.system_prompt and (not turns or turns[0]["role"] != "system"):
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        return self._llm.render_chat(turns)


def _assistant(text: str) -> ChatMessage:
    return ChatMessage(role=MessageRole.ASSISTANT, content=text)


def _texts(stream) -> Iterator[tuple[str, str, Any]]:
    """(text so far, new text, the RequestOutput) per step of an ``LLM.stream``."""
    text = ""
    try:
        for out in stream:
            text += out.delta_text
            yield text, out.delta_text, out
    finally:
        stream.close()  # abandoning the stream aborts the request


async def _in_thread(gen):
    """``gen``'s items, each pulled on a worker thread (the engine steps off the event loop)."""
    try:
        while (item := await asyncio.to_thread(next, gen, _END)) is not _END:
            yield item
    finally:
        await asyncio.to_thread(gen.close)
