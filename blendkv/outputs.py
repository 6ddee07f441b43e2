"""What ``LLM.generate`` returns (vLLM's shapes, plus per-request metrics and blend stats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # the stop string / token that ended it
    cumulative_logprob: float | None = None
    # Per generated token: {token_id: logprob} with the sampled token first, when requested.
    logprobs: list[dict[int, float]] | None = None
    # Streaming: the text this completion added since the request's previous output.
    delta_text: str = ""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times in seconds (``time.perf_counter`` clock); token counts in tokens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Blend statistics of a blended request (a BlendStats), None for plain prompts.
    blend_stats: Any = None
    # Streaming: the text added since the previous output of this request (of ``outputs[0]``;
    # with ``n > 1`` each completion has its own ``delta_text``).
    delta_text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: None, then per prompt token {token: logprob, top-k...};
    # set once the prompt is computed (blendkv.engine.prompt_logprobs).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text
