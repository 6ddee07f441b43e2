"""Requests in: tokenise and validate a prompt into a :class:`PreparedRequest` (vLLM's
``InputProcessor``), touching no engine state.

Kept apart from the engine loop so that a front end may prepare requests on its own thread
(:class:`~blendkv.entrypoints.async_llm.AsyncLLM` does): only ``LLMEngine.add_prepared`` must run
on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blendkv.engine.kv_connector import KVConnectorBase
from blendkv.errors import (
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
)
from blendkv.sampling_params import SamplingParams
from blendkv.text import replace_lone_surrogates


@dataclass
class PreparedRequest:
    """A validated request, ready to queue."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    request_id: str | None = None
    prompt: str | None = None
    kv_transfer_params: Any = None  # the KV connector's payload for a dict prompt
    cache_salt: bytes = b""
    logits_from: int | None = None
    approximate: bool = False  # its K/V is not exactly full prefill's (the audit may sample it)
    stats: Any = None  # the connector's stats object its outputs carry (an audit joins it)


class InputProcessor:
    """Tokenises and validates prompts for one engine (``info``: its RuntimeInfo)."""

    def __init__(
        self,
        tokenizer: Any,
        info: Any,
        max_num_seqs: int,
        connector: KVConnectorBase,
        id_in_use: Callable[[str], bool],
    ) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.max_num_seqs = max_num_seqs
        self.connector = connector
        self.id_in_use = id_in_use

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            prompt = replace_lone_surrogates(prompt, "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidRequestError(
                f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        bad = [t for t in prompt if not 0 <= t < self.info.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids out of range [0, {self.info.vocab_size}): {bad[:5]}"
            )
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: object) -> SamplingParams:
        """Raise a typed error for a request that cannot be served; the engine is untouched."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        bad = sorted(t for t in params.logit_bias if t >= self.info.vocab_size)
        if bad:
            raise InvalidSamplingParamsError(
                f"SamplingParams.logit_bias names token ids outside the vocabulary "
                f"[0, {self.info.vocab_size}): {bad[:5]}"
            )
        if params.n > self.max_num_seqs:
            raise InvalidSamplingParamsError(
                f"SamplingParams.n={params.n} exceeds max_num_seqs={self.max_num_seqs} "
                "(the n samples run together); lower n or raise max_num_seqs"
            )
        if not prompt_token_ids:
            raise EmptyPromptError("the prompt is empty (zero tokens)")
        if len(prompt_token_ids) >= self.info.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                f"{self.info.max_model_len} (room for at least one output token is needed); "
                "shorten the prompt or raise max_model_len / the KV pool size"
            )
        return params

    def prepare_request(
        self,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        blend: object = None,
        logits_from: int | None = None,
        token_map: bool = False,
    ) -> PreparedRequest:
        """See :meth:`blendkv.engine.llm_engine.LLMEngine.prepare_request`."""
        connector_prompt = None
        if isinstance(prompt, dict):
            connector_prompt = self.connector.prepare_prompt(prompt, blend, token_map=token_map)
            token_ids = connector_prompt.token_ids
        elif blend is not None:
            raise InvalidRequestError("a blend config needs a blended prompt (a dict)")
        elif token_map:
            raise InvalidRequestError(
                "token_map needs a blended prompt (a dict): every token of a plain prompt is "
                "computed"
            )
        else:
            token_ids = self.tokenize(prompt)
        params = self.validate(token_ids, sampling_params)
        if request_id is not None and self.id_in_use(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.prompt_logprobs is not None:
            if connector_prompt is not None:
                raise InvalidSamplingParamsError(
                    "SamplingParams.prompt_logprobs is not supported for a blended prompt "
                    "(documents or rag): its reused chunks' rows are not computed through every "
                    "layer, so their logprobs would not be the model's"
                )
            if logits_from not in (None, 0):
                raise InvalidRequestError("prompt_logprobs and logits_from cannot be combined")
            logits_from = 0
        if logits_from is not None and not 0 <= logits_from < len(token_ids):
            raise InvalidRequestError(f"logits_from={logits_from} is outside the prompt")
        if connector_prompt is not None and logits_from is not None:
            if logits_from < connector_prompt.min_logits_position:
                raise InvalidRequestError(
                    f"logits_from={logits_from}: this prompt has logits only from position "
                    f"{connector_prompt.min_logits_position} on (reused chunk rows are not "
                    "computed through every layer)"
                )
        prompt_text = prompt if isinstance(prompt, str) else None
        return PreparedRequest(
            token_ids,
            params,
            request_id,
            prompt_text,
            kv_transfer_params=connector_prompt and connector_prompt.kv_transfer_params,
            cache_salt=connector_prompt.cache_salt if connector_prompt is not None else b"",
            logits_from=logits_from,
            approximate=connector_prompt is not None and connector_prompt.approximate,
            stats=connector_prompt and connector_prompt.stats,
        )
