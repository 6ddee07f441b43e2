"""Presence, frequency and repetition penalties, and ``logit_bias`` (vLLM's semantics).

Per penalised row, with ``counts[t]`` the times the request has generated token t and
``seen[t]`` whether t occurs in its prompt or its output::

    repetition:  logit[t] = logit[t] / r  if logit[t] >= 0 else logit[t] * r   where seen[t]
    frequency:   logit[t] -= f * counts[t]
    presence:    logit[t] -= p * (counts[t] > 0)

The repetition step is transformers' ``RepetitionPenaltyLogitsProcessor`` (the same float ops,
so greedy decoding matches ``generate(repetition_penalty=r)``); frequency and presence are
OpenAI's definitions, over output tokens only.

The counts live on the device, one row per request that has a penalty (:class:`TokenCounts`).
Each step adds only the tokens a request generated since the last one, taken from its Python
list of output ids: no device-to-host copy, and no per-step copy of whole sequences.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from blendkv.engine.sequence import Sequence
    from blendkv.sampling_params import SamplingParams


class PenaltyInputs(NamedTuple):
    """The penalised rows of one step's batch and their token statistics.

    rows: ascending row indices (into the step's logits) of the requests with a penalty.
    output_counts: ``[len(rows), vocab]`` int32, times each token was generated.
    prompt_mask: ``[len(rows), vocab]`` bool, whether each token occurs in the prompt.
    """

    rows: list[int]
    output_counts: torch.Tensor
    prompt_mask: torch.Tensor


class TokenCounts:
    """Per request with a penalty: a device row of output-token counts and a prompt mask.

    Rows are slots of two growing ``[capacity, vocab]`` tensors, taken when a request is first
    sampled and handed back by :meth:`release` (finish or abort). A request keeps its slot while
    preempted: its output ids survive preemption, so its counts stay right.
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self.slots: dict[str, int] = {}
        # Output tokens of each request already added to its counts row.
        self.num_counted: dict[str, int] = {}
        self.free_slots: list[int] = []

    def inputs(self, seqs: Seq[Sequence]) -> PenaltyInputs | None:
        """The penalty inputs of a step sampling ``seqs`` (None when no request has one)."""
        rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.has_penalties]
        if not rows:
            return None
        slot_of_row: list[int] = []
        count_slots: list[int] = []
        count_ids: list[int] = []
        for i in rows:
            seq = seqs[i]
            slot = self.slots.get(seq.request_id)
            if slot is None:
                slot = self._assign(seq)
            counted = self.num_counted[seq.request_id]
            new = seq.output_token_ids[counted:]
            count_slots.extend([slot] * len(new))
            count_ids.extend(new)
            self.num_counted[seq.request_id] = counted + len(new)
            slot_of_row.append(slot)
        if count_ids:
            index = (self._tensor(count_slots), self._tensor(count_ids))
            ones = torch.ones(len(count_ids), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(index, ones, accumulate=True)
        slots = self._tensor(slot_of_row)
        return PenaltyInputs(rows, self.output_counts[slots], self.prompt_mask[slots])

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            del self.num_counted[request_id]
            self.free_slots.append(slot)

    def check_integrity(self) -> None:
        used = set(self.slots.values())
        assert len(used) == len(self.slots), "two requests share a counts row"
        assert used.isdisjoint(self.free_slots), "a used counts row is also free"
        assert len(used) + len(self.free_slots) == self.output_counts.shape[0]

    def _assign(self, seq: Sequence) -> int:
        if not self.free_slots:
            self._grow()
        slot = self.free_slots.pop()
        self.output_counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot, self._tensor(seq.prompt_token_ids)] = True
        self.slots[seq.request_id] = slot
        self.num_counted[seq.request_id] = 0
        return slot

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        new = max(8, 2 * old)
        counts = self.output_counts.new_zeros(new, self.vocab_size)
        mask = self.prompt_mask.new_zeros(new, self.vocab_size)
        counts[:old] = self.output_counts
        mask[:old] = self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        # Popped from the end: the lowest new slot is used first.
        self.free_slots.extend(range(new - 1, old - 1, -1))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def apply_penalties(
    logits: torch.Tensor, params: Seq[SamplingParams], inputs: PenaltyInputs
) -> None:
    """Penalise ``logits`` ``[num_seqs, vocab]`` (float32) in place; ``params`` per row."""
    device = logits.device
    sub = logits[inputs.rows]
    chosen = [params[i] for i in inputs.rows]
    counts = inputs.output_counts
    generated = counts > 0
    if any(p.repetition_penalty != 1.0 for p in chosen):
        r = torch.tensor([p.repetition_penalty for p in chosen], device=device).unsqueeze(1)
        # transformers' form: negative logits are multiplied, the rest (0 included) divided.
        penalised = torch.where(sub < 0, sub * r, sub / r)
        sub = torch.where(inputs.prompt_mask | generated, penalised, sub)
    if any(p.frequency_penalty != 0.0 for p in chosen):
        f = torch.tensor([p.frequency_penalty for p in chosen], device=device).unsqueeze(1)
        sub -= f * counts
    if any(p.presence_penalty != 0.0 for p in chosen):
        pp = torch.tensor([p.presence_penalty for p in chosen], device=device).unsqueeze(1)
        sub -= pp * generated
    logits[inputs.rows] = sub


def apply_logit_bias(logits: torch.Tensor, params: Seq[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` to ``logits`` ``[num_seqs, vocab]`` in place.

    Token ids were checked against the vocabulary when the request was added.
    """
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)
