"""What ``LLM.generate`` returns (vLLM's shapes, plus per-request metrics and blend stats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``RequestOutput.outputs``; ``n`` of them).

    Attributes:
        index: which of the request's ``n`` samples this is (0 .. n-1).
        text: the generated text so far (detokenized; stop strings cut as asked).
        token_ids: the generated token ids so far.
        finish_reason: "stop" (EOS, a stop token or string), "length" (``max_tokens`` or
            ``max_model_len``), "abort", or None while running.
        stop_reason: the stop string or stop token id that ended it; None otherwise.
        cumulative_logprob: the sum of the sampled tokens' logprobs, when logprobs were asked
            for; else None.
        logprobs: per generated token, ``{token_id: logprob}`` with the sampled token first,
            when ``SamplingParams.logprobs`` is set; else None.
        delta_text: streaming: the text this completion added since the request's previous
            output.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""

    def finished(self) -> bool:
        """Whether this sequence has ended (it has a ``finish_reason``)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request's steps happened and what its prompt cost (``RequestOutput.metrics``).

    Times are in seconds on the ``time.perf_counter`` clock (compare them with each other, not
    with wall time); token counts in tokens.

    Attributes:
        arrival_time: when the engine received the request.
        first_scheduled_time: when a step first computed any of it; None before.
        first_token_time: when its first output token was sampled; None before.
        finished_time: when it finished; None while running.
        num_prompt_tokens: the prompt's length in tokens (a blended prompt's whole length:
            template, documents and query).
        num_cached_tokens: prompt tokens whose K/V came from the prefix cache.
        num_preemptions: how often the scheduler preempted it to free KV blocks (each time
            it is recomputed later).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish, in seconds; None while running."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """One request's output: what ``LLM.generate`` returns per prompt, and what a stream
    yields after every step (vLLM's ``RequestOutput``).

    Attributes:
        request_id: the request's id (``LLM`` numbers them; the server uses its own).
        prompt: the prompt text, when the prompt was text; None for token ids and blended
            (dict) prompts.
        prompt_token_ids: the prompt as the model saw it (a blended prompt's template,
            documents and query).
        outputs: one :class:`CompletionOutput` per sample (``SamplingParams.n``).
        finished: whether every sample has finished.
        metrics: its :class:`RequestMetrics` (``metrics.ttft``: time to first token).
        blend_stats: a blended request's :class:`~blendkv.blend.stats.BlendStats` (what was
            reused, repaired and computed); None for plain prompts.
        delta_text: streaming: the text ``outputs[0]`` added since this request's previous
            output (with ``n > 1`` each completion has its own ``delta_text``).
        extra: engine extras a caller asked for: ``prompt_logits`` (the prompt's logits from
            a given position on, a tensor; the evaluation uses them); else empty.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: None for the first prompt
            token, then per prompt token ``{token_id: logprob}`` (its own and the top k), set
            once the prompt is computed; else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    blend_stats: Any = None
    delta_text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        """The first sample's text (``outputs[0].text``)."""
        return self.outputs[0].text
