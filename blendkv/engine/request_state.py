"""Output processing for one request: detokenise, check stops, build ``RequestOutput``s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blendkv.engine.detokenizer import IncrementalDetokenizer
from blendkv.engine.prompt_logprobs import prompt_logprobs
from blendkv.engine.sequence import Sequence, SequenceStatus
from blendkv.engine.stop_checker import check_stop, stop_holdback_len
from blendkv.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from blendkv.engine.parallel_sampling import ParentRequest

_FINISH_STATUS = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
}


class RequestState:
    def __init__(self, seq: Sequence, prompt: str | None, tokenizer) -> None:
        self.seq = seq
        self.prompt = prompt
        params = seq.sampling_params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, seq.prompt_token_ids, params.skip_special_tokens
        )
        self.text = ""
        self.num_streamed_chars = 0
        self.holdback = stop_holdback_len(params)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logits: list = []  # [rows, vocab] tensors for Sequence.logits_from
        self.parent: ParentRequest | None = None  # set for the samples of an n > 1 request

        self.prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs, once done

    def add_prompt_logits(self, logits) -> None:
        if self.prompt_logprobs is None:  # a recompute after preemption changes nothing then
            self.prompt_logits.append(logits)

    def _take_prompt_logprobs(self) -> list | None:
        """The prompt logprobs once every prompt row has arrived (then the logits are freed)."""
        k = self.seq.sampling_params.prompt_logprobs
        if k is None or self.prompt_logprobs is not None:
            return self.prompt_logprobs
        n = self.seq.num_prompt_tokens
        if sum(t.shape[0] for t in self.prompt_logits) < n:
            return None
        import torch

        rows = torch.cat(self.prompt_logits)[-n:]  # the last pass after a preemption
        self.prompt_logprobs = prompt_logprobs(rows, self.seq.prompt_token_ids, k)
        self.prompt_logits = []
        return self.prompt_logprobs

    def append(self, token_id, logprob, top_logprobs, now, eos_token_ids) -> SequenceStatus | None:
        """Record one sampled token; return the finished status if the request stops."""
        seq = self.seq
        seq.append_token(token_id)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        if self.logprobs is not None:
            entry = {token_id: logprob}
            entry.update({t: lp for t, lp in (top_logprobs or []) if t != token_id})
            self.logprobs.append(entry)
            self.cumulative_logprob += logprob
        delta = self.detokenizer.add(token_id)
        self.text += delta
        eos = token_id if token_id in eos_token_ids else (eos_token_ids or (None,))[0]
        result = check_stop(
            new_token_id=token_id,
            num_output_tokens=seq.num_output_tokens,
            output_text=self.text,
            new_text_len=len(delta),
            params=seq.sampling_params,
            eos_token_id=eos,
            max_output_tokens=seq.max_output_tokens,
        )
        if result.truncate_text_to is not None:
            self.text = self.text[: result.truncate_text_to]
        if result.finish_reason is None:
            return None
        if result.truncate_text_to is None:
            self.text += self.detokenizer.finish()  # flush a held-back partial character
        self.finish_reason = result.finish_reason
        self.stop_reason = result.stop_reason
        return _FINISH_STATUS[result.finish_reason]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def make_output(self, blend_stats=None) -> RequestOutput:
        """The output so far; ``blend_stats`` are the KV connector's stats for this request."""
        completion = self.completion(0)
        return RequestOutput(
            request_id=self.seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.seq.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            metrics=self.metrics(),
            blend_stats=blend_stats,
            delta_text=completion.delta_text,
            extra=self.extra(),
            prompt_logprobs=self._take_prompt_logprobs(),
        )

    def extra(self) -> dict:
        """``RequestOutput.extra``: the prompt logits asked for (``Sequence.logits_from``)."""
        if not self.prompt_logits or self.seq.sampling_params.prompt_logprobs is not None:
            return {}
        import torch

        # A preempted request recomputes its prompt from ``logits_from`` (prefix matching stops
        # there), so its rows arrive again from the first one: the last pass is the whole set.
        rows = self.seq.num_prompt_tokens - self.seq.logits_from
        return {"prompt_logits": torch.cat(self.prompt_logits)[-rows:]}

    def completion(self, index: int) -> CompletionOutput:
        """This sequence's completion so far; its ``delta_text`` is the text made visible since
        the previous call (a stop string's possible start is held back until it is decided)."""
        visible = len(self.text) if self.finished else max(len(self.text) - self.holdback, 0)
        visible = max(visible, self.num_streamed_chars)
        delta = self.text[self.num_streamed_chars : visible]
        self.num_streamed_chars = visible
        return CompletionOutput(
            index=index,
            text=self.text,
            token_ids=list(self.seq.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            delta_text=delta,
        )

    def metrics(self) -> RequestMetrics:
        seq = self.seq
        m = seq.metrics
        return RequestMetrics(
            arrival_time=m.arrival_time,
            first_scheduled_time=m.first_scheduled_time,
            first_token_time=m.first_token_time,
            finished_time=m.finished_time,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=m.num_cached_tokens,
            num_preemptions=m.num_preemptions,
        )
