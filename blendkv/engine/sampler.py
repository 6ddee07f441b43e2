"""Turns one row of logits per sequence into one token per sequence (pure torch, CPU or CUDA).

Per row, in this order (vLLM's and transformers')::

    structured outputs:             tokens the row's grammar forbids -> -inf (greedy rows too;
                                    a complete grammar's EOS outranks min_tokens)
    logit_bias:                     logits[token] += bias                   (greedy rows too)
    min_tokens not reached yet:     EOS and stop_token_ids logits -> -inf   (greedy rows too)
    penalties:                      repetition, frequency, presence         (greedy rows too)
    greedy rows (temperature ~ 0):  token = logits.argmax(-1)          (ties -> lowest id)
    random rows:                    logits / temperature
                                    -> top-k   (keep the k largest)
                                    -> top-p   (smallest prefix of the sorted probs with sum >= p)
                                    -> min-p   (drop p_i < min_p * p_max)
                                    -> draw with the row's own torch.Generator

Filtering is vectorised over the random rows; only the draw loops, so a seeded request gets the
same token whatever else is in the batch. Below ``min_tokens`` EOS and stop ids cannot be
*sampled* (vLLM), whatever ``ignore_eos`` says. Logprobs are ``log_softmax`` of the *raw*
logits: nothing above changes them (vLLM's ``raw_logprobs``). Penalties:
:mod:`blendkv.engine.penalties`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from blendkv.engine.penalties import PenaltyInputs, apply_logit_bias, apply_penalties
from blendkv.engine.structured_output import apply_bitmask
from blendkv.sampling_params import SamplingParams


class SamplerOutput(NamedTuple):
    """One entry per input row.

    token_ids: the sampled token of each row.
    logprobs: the sampled token's logprob, or None where ``params.logprobs`` is None.
    top_logprobs: the ``params.logprobs`` most likely ``(token_id, logprob)`` pairs sorted by
        logprob descending (an empty list for ``logprobs=0``), or None where not requested.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Holds only run-time facts (the EOS ids); per-request state (generators, output counts)
    is passed in by the caller.

    ``eos_token_ids``: the model's EOS ids (``RuntimeInfo.eos_token_ids``), masked together
    with each request's ``stop_token_ids`` until it has ``min_tokens`` output tokens.
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        num_output_tokens: list[int],
        penalties: PenaltyInputs | None = None,
        token_bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[num_seqs, vocab]`` (any float dtype).

        ``generators[i]`` draws row i (it must live on ``logits.device``); None uses the global
        RNG of that device. Greedy rows never touch their generator. ``num_output_tokens[i]``
        is how many tokens row i's request has generated before this one (for ``min_tokens``).
        ``penalties``: the token counts of the rows whose params have a penalty (required
        when any has one; :class:`~blendkv.engine.penalties.TokenCounts` builds them).
        ``token_bitmask``: ``(bitmask, rows)``, the allowed tokens of the rows under a grammar
        (:mod:`blendkv.engine.structured_output`); required when any row has one.
        """
        assert logits.dim() == 2, f"logits must be [num_seqs, vocab], got {tuple(logits.shape)}"
        num_seqs = logits.shape[0]
        assert len(params) == num_seqs == len(generators) == len(num_output_tokens), (
            num_seqs,
            len(params),
            len(generators),
            len(num_output_tokens),
        )
        raw = logits.float()
        logits = self._processed_logits(raw, params, num_output_tokens, penalties, token_bitmask)
        token_ids = logits.argmax(dim=-1)

        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            sampled = self._sample_random(
                logits[random_rows],
                [params[i] for i in random_rows],
                [generators[i] for i in random_rows],
            )
            token_ids[random_rows] = sampled

        logprobs, top_logprobs = self._gather_logprobs(raw, token_ids, params)
        return SamplerOutput(token_ids.tolist(), logprobs, top_logprobs)

    def _processed_logits(
        self,
        raw: torch.Tensor,
        params: list[SamplingParams],
        num_output_tokens: list[int],
        penalties: PenaltyInputs | None,
        token_bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> torch.Tensor:
        """``raw`` after the grammar mask, logit_bias, the min-tokens mask and the penalties.

        Returns ``raw`` itself when no row needs any, else a copy (the raw logits stay
        untouched for the logprobs).
        """
        stop_rows, stop_cols = self._stop_token_mask(raw.shape[-1], params, num_output_tokens)
        has_bias = any(p.logit_bias for p in params)
        if penalties is None:
            assert not any(p.has_penalties for p in params), "penalised rows need their counts"
        if token_bitmask is None:
            assert not any(p.structured_outputs for p in params), "constrained rows need a mask"
        if not (stop_rows or has_bias or penalties is not None or token_bitmask is not None):
            return raw
        logits = raw.clone()
        if token_bitmask is not None:
            apply_bitmask(logits, *token_bitmask)
        if has_bias:
            apply_logit_bias(logits, params)
        if stop_rows:
            logits[stop_rows, stop_cols] = float("-inf")
        if penalties is not None:
            apply_penalties(logits, params, penalties)
        if token_bitmask is not None and stop_rows:
            self._grammar_beats_min_tokens(logits, raw, token_bitmask)
        return logits

    @staticmethod
    def _grammar_beats_min_tokens(
        logits: torch.Tensor, raw: torch.Tensor, token_bitmask: tuple[torch.Tensor, list[int]]
    ) -> None:
        """A complete grammar allows only EOS, which ``min_tokens`` forbids: such a row would
        have no token left, so it gets the grammar's tokens back (the grammar wins)."""
        bitmask, rows = token_bitmask
        dead = torch.isneginf(logits[rows]).all(dim=-1).tolist()
        for j, i in enumerate(rows):
            if dead[j]:
                row = raw[i : i + 1].clone()
                apply_bitmask(row, bitmask[j : j + 1], [0])
                logits[i] = row[0]

    def _stop_token_mask(
        self, vocab_size: int, params: list[SamplingParams], num_output_tokens: list[int]
    ) -> tuple[list[int], list[int]]:
        """(rows, cols) of the EOS and stop-token ids of rows still short of ``min_tokens``."""
        rows: list[int] = []
        cols: list[int] = []
        for i, (p, n) in enumerate(zip(params, num_output_tokens, strict=True)):
            if n < p.min_tokens:
                ids = {*self.eos_token_ids, *p.stop_token_ids}
                ids = [t for t in ids if 0 <= t < vocab_size]
                rows.extend([i] * len(ids))
                cols.extend(ids)
        return rows, cols

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Sample ``[n]`` token ids from ``logits`` ``[n, vocab]`` (float32, all rows random)."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature.unsqueeze(1)

        needs_filter = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
        if needs_filter:
            probs, order = _filtered_sorted_probs(logits, params)
        else:
            probs, order = logits.softmax(dim=-1), None

        # The draw is per row so that each row consumes only its own generator.
        picked = torch.empty(len(params), dtype=torch.long, device=device)
        for i, g in enumerate(generators):
            picked[i] = torch.multinomial(probs[i], 1, generator=g)[0]
        if order is not None:
            picked = order.gather(1, picked.unsqueeze(1)).squeeze(1)
        return picked

    @staticmethod
    def _gather_logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        num_seqs = logits.shape[0]
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list[float | None] = [None] * num_seqs
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * num_seqs
        if not wanted:
            return logprobs, top_logprobs
        all_logprobs = logits[wanted].log_softmax(dim=-1)
        chosen = all_logprobs.gather(1, token_ids[wanted].unsqueeze(1)).squeeze(1).tolist()
        k = max(params[i].logprobs for i in wanted)
        top_values, top_ids = all_logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        # One .tolist() per tensor: a device sync per value would dominate on CUDA.
        top_values = top_values.tolist() if k > 0 else None
        top_ids = top_ids.tolist() if k > 0 else None
        for j, i in enumerate(wanted):
            n = params[i].logprobs
            logprobs[i] = chosen[j]
            top_logprobs[i] = list(zip(top_ids[j][:n], top_values[j][:n], strict=True)) if n else []
        return logprobs, top_logprobs


def _filtered_sorted_probs(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k, top-p and min-p to temperature-scaled ``logits`` ``[n, vocab]``.

    Returns ``(probs, order)``, both ``[n, vocab]``, in descending-logit order: ``probs[i, j]``
    is the (unnormalised) probability of token ``order[i, j]``, zero where filtered out. Position
    0 (the argmax, lowest id among ties since the sort is stable) always survives every filter.
    """
    device = logits.device
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=device).unsqueeze(0)

    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
    sorted_logits = sorted_logits.masked_fill(positions >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)

    # Keep token j iff the tokens before it sum to < top_p: the smallest prefix reaching top_p.
    # top_p == 1 skips the test, since float round-off can push the running sum past 1.0 early.
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p) & (top_p < 1.0)

    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    drop |= probs < min_p * probs[:, :1]
    return probs.masked_fill(drop, 0.0), order
