"""Per-request size limits of the OpenAI server, checked before a request costs anything.

Before tokenising (on the event loop, from byte lengths alone):

- the prompt text (a completion's prompt, or the chat messages' text) may take at most
  ``max_prompt_bytes``, by default :data:`BYTES_PER_TOKEN` bytes per token of ``max_model_len``
  (text averages a few bytes per token; only long runs of one character, such as spaces, pack
  more), so a longer prompt would not fit anyway;
- a chat request may carry at most ``max_request_documents`` documents, and their text at most
  ``BYTES_PER_TOKEN * max_document_tokens`` bytes;
- ``max_tokens`` is below ``max_model_len`` (a prompt takes at least one token).

After tokenising (on the prepare thread, :meth:`RequestLimits.check_prepared`, before the
request is queued): the documents may take at most ``max_document_tokens`` tokens in all, and
the prompt and ``max_tokens`` together at most ``max_model_len`` (vLLM's check; an unset
``max_tokens`` is the room left). Each refusal is a :class:`RequestLimitError`, a 400 whose
message names the limit and the server flag that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blendkv.entrypoints.openai.errors import APIError

BYTES_PER_TOKEN = 16  # a generous bound on the bytes of text per token
DEFAULT_MAX_REQUEST_DOCUMENTS = 1024


class RequestLimitError(APIError):
    """A request over one of the server's size limits (HTTP 400, ``code`` names the limit)."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(400, message, param=param, code=code)


@dataclass(frozen=True)
class RequestLimits:
    """The limits of one server; :meth:`for_model` derives the defaults from the model."""

    max_prompt_bytes: int
    max_request_documents: int
    max_document_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        names = ("max_prompt_bytes", "max_request_documents", "max_document_tokens")
        for name in (*names, "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @classmethod
    def for_model(
        cls,
        max_model_len: int,
        max_request_documents: int | None = None,
        max_document_tokens: int | None = None,
    ) -> RequestLimits:
        """Defaults: ``BYTES_PER_TOKEN * max_model_len`` prompt bytes, 1024 documents, and
        ``max_model_len`` document tokens (documents are part of the prompt)."""
        return cls(
            max_prompt_bytes=BYTES_PER_TOKEN * max_model_len,
            max_request_documents=max_request_documents or DEFAULT_MAX_REQUEST_DOCUMENTS,
            max_document_tokens=max_document_tokens or max_model_len,
            max_model_len=max_model_len,
        )

    # ------------------------------------------------------------ before tokenising
    def check_completion(self, prompt: Any) -> None:
        """A completion's prompt (text or token ids)."""
        prompts = prompt if isinstance(prompt, list) and prompt else [prompt]
        texts = [p for p in prompts if isinstance(p, str)]
        self._check_prompt_bytes(sum(_nbytes(t) for t in texts), "prompt")

    def check_chat(self, messages: list, documents: list | None) -> None:
        """A chat request's messages (``ChatMessage``) and documents (``Document``)."""
        self._check_prompt_bytes(sum(_nbytes(m.text()) for m in messages), "messages")
        if documents is None:
            return
        if len(documents) > self.max_request_documents:
            raise RequestLimitError(
                f"the request has {len(documents)} documents; this server takes at most "
                f"{self.max_request_documents} per request (--max-request-documents)",
                param="documents",
                code="too_many_documents",
            )
        nbytes = sum(_nbytes(d.text) + _nbytes(d.title or "") for d in documents)
        if nbytes > BYTES_PER_TOKEN * self.max_document_tokens:
            raise RequestLimitError(
                f"the documents take {nbytes} bytes, more than {self.max_document_tokens} "
                f"tokens can hold ({BYTES_PER_TOKEN} bytes per token); this server takes at "
                f"most {self.max_document_tokens} document tokens per request "
                "(--max-document-tokens)",
                param="documents",
                code="documents_too_long",
            )

    def check_max_tokens(self, max_tokens: int | None, param: str = "max_tokens") -> None:
        """``max_tokens`` (named ``param`` in the request) leaves room for a prompt."""
        if max_tokens is not None and max_tokens >= self.max_model_len:
            raise RequestLimitError(
                f"{param} is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens, prompt and output together (--max-model-len)",
                param=param,
                code="context_length_exceeded",
            )

    def _check_prompt_bytes(self, nbytes: int, param: str) -> None:
        if nbytes > self.max_prompt_bytes:
            raise RequestLimitError(
                f"the {param} take {nbytes} bytes, more than the {self.max_prompt_bytes}-byte "
                f"limit ({BYTES_PER_TOKEN} bytes per token of max_model_len): it cannot fit "
                "the model's context; shorten it",
                param=param,
                code="prompt_too_large",
            )

    # ------------------------------------------------------------- after tokenising
    def check_prepared(self, prepared: Any, max_tokens_param: str = "max_tokens") -> None:
        """A tokenised request (``PreparedRequest``): its prompt with ``max_tokens`` (named
        ``max_tokens_param`` in the request) and, for a blended one, its document tokens."""
        blended = getattr(prepared.kv_transfer_params, "prompt", None)
        num_tokens = getattr(blended, "num_chunk_tokens", 0)
        if num_tokens > self.max_document_tokens:
            raise RequestLimitError(
                f"the documents take {num_tokens} tokens; this server takes at most "
                f"{self.max_document_tokens} document tokens per request (--max-document-tokens)",
                param="documents",
                code="documents_too_long",
            )
        num_prompt = len(prepared.prompt_token_ids)
        max_tokens = prepared.sampling_params.max_tokens
        if max_tokens is not None and num_prompt + max_tokens > self.max_model_len:
            raise RequestLimitError(
                f"{max_tokens_param} is too large: {max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and the request has {num_prompt} prompt "
                f"tokens ({max_tokens} > {self.max_model_len} - {num_prompt}); lower "
                f"{max_tokens_param} or leave it unset (the room left)",
                param=max_tokens_param,
                code="context_length_exceeded",
            )


def _nbytes(text: str) -> int:
    """UTF-8 length (lone surrogates count as the 3 bytes their replacement takes)."""
    return len(text.encode("utf-8", "surrogatepass"))
