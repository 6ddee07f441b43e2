"""Parallel sampling (``SamplingParams.n > 1``): one request, n sequences (vLLM's
``ParentRequest``).

Sample i is a sequence of its own with ``n=1`` and, given a seed, ``seed + i`` (vLLM's
convention: sample i draws the tokens a single request with that seed would). Sample 0 keeps the
request id, by which the KV connector knows the request; sample i > 0 is ``f"{i}_{request_id}"``.
Samples 1.. wait in sample 0's ``pending_children`` until the scheduler forks them from it, once
the prompt's K/V is computed (blended or not, it is computed once and shared by block).

The engine emits one :class:`~blendkv.outputs.RequestOutput` per request and step, holding all
n completions (``index`` 0..n-1, each with its own ``delta_text`` and finish reason); it is
finished when every sample is.
"""

from __future__ import annotations

import dataclasses

from blendkv.engine.request_state import RequestState
from blendkv.outputs import RequestOutput
from blendkv.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{index}_{request_id}"


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s params: ``n=1``, and ``seed + index`` when seeded."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    """The n samples of one request and their combined output."""

    def __init__(self, request_id: str, states: list[RequestState]) -> None:
        assert len(states) > 1 and states[0].seq.request_id == request_id
        self.request_id = request_id
        self.states = states
        for state in states:
            state.parent = self

    @property
    def finished(self) -> bool:
        return all(state.finished for state in self.states)

    def make_output(self, blend_stats=None) -> RequestOutput:
        """Every sample's completion so far (one delta per sample since the last call)."""
        first = self.states[0]
        completions = [state.completion(i) for i, state in enumerate(self.states)]
        finished = self.finished
        metrics = first.metrics()
        seq_metrics = [state.seq.metrics for state in self.states]
        first_tokens = [m.first_token_time for m in seq_metrics if m.first_token_time is not None]
        metrics.first_token_time = min(first_tokens, default=None)
        metrics.num_preemptions = sum(m.num_preemptions for m in seq_metrics)
        if finished:
            ends = [m.finished_time for m in seq_metrics if m.finished_time is not None]
            metrics.finished_time = max(ends, default=None)
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.seq.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            blend_stats=blend_stats,
            delta_text=completions[0].delta_text,
            extra=first.extra(),
            prompt_logprobs=first._take_prompt_logprobs(),
        )
