"""Presence, frequency and repetition penalties, and ``logit_bias`` (vLLM's semantics).

Per penalised row, with ``counts[t]`` the times the request has generated token t and
``seen[t]`` whether t occurs in its prompt or its output::

    repetition:  logit[t] = logit[t] / r  if logit[t] >= 0 else logit[t] * r   where seen[t]
    frequency:   logit[t] -= f * counts[t]
    presence:    logit[t] -= p * (counts[t] > 0)

The repetition step is transformers' ``RepetitionPenaltyLogitsProcessor`` (the same float ops,
so greedy decoding matches ``generate(repetition_penalty=r)``); frequency and presence are
OpenAI's definitions, over output tokens only.

Only the tokens a row has seen can change, so the penalties run on those alone (a gather, the
arithmetic, a scatter over ``[rows, distinct tokens]``, never over the vocabulary). They live on
the device, one row per request that has a penalty (:class:`TokenCounts`): the distinct token
ids of its prompt and output, and how often it generated each. Each step adds only the tokens a
request generated since the last one, from its Python list of output ids: no device-to-host
copy, and no per-step copy of whole sequences.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from blendkv.engine.sequence import Sequence
    from blendkv.sampling_params import SamplingParams


class PenaltyInputs(NamedTuple):
    """The penalised rows of one step's batch and the tokens each has seen.

    rows: ascending row indices (into the step's logits) of the requests with a penalty.
    token_ids: ``[len(rows), width]`` int64, the distinct tokens of each row's prompt and
        output, padded with repeats of its first one (a repeat is penalised to the same value).
    output_counts: ``[len(rows), width]`` int32, times each of those tokens was generated.
    """

    rows: list[int]
    token_ids: torch.Tensor
    output_counts: torch.Tensor


class TokenCounts:
    """Per request with a penalty: its seen tokens and their output counts, on the device.

    Requests own slots (rows) of two growing ``[capacity, width]`` tensors, taken when a request
    is first sampled and handed back by :meth:`release` (finish or abort); ``width`` grows to
    the most distinct tokens a request has seen. ``columns[request_id]`` maps a seen token id
    to its column. A request keeps its slot while preempted: its output ids survive
    preemption, so its counts stay right.
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.token_ids = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.output_counts = torch.zeros(0, 0, dtype=torch.int32, device=self.device)
        self.slots: dict[str, int] = {}
        self.columns: dict[str, dict[int, int]] = {}
        # Output tokens of each request already added to its counts row.
        self.num_counted: dict[str, int] = {}
        self.free_slots: list[int] = []

    @property
    def width(self) -> int:
        return self.token_ids.shape[1]

    def inputs(self, seqs: Seq[Sequence]) -> PenaltyInputs | None:
        """The penalty inputs of a step sampling ``seqs`` (None when no request has one)."""
        rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.has_penalties]
        if not rows:
            return None
        slot_of_row: list[int] = []
        new_slots: list[int] = []  # a token a request had not seen: its slot, column, id
        new_cols: list[int] = []
        new_ids: list[int] = []
        count_slots: list[int] = []  # one per generated token: its slot and column
        count_cols: list[int] = []
        width = 0
        for i in rows:
            seq = seqs[i]
            request_id = seq.request_id
            slot = self.slots.get(request_id)
            if slot is None:
                slot = self._assign(seq)
            columns = self.columns[request_id]
            for token_id in seq.output_token_ids[self.num_counted[request_id] :]:
                col = columns.get(token_id)
                if col is None:
                    col = columns[token_id] = len(columns)
                    new_slots.append(slot)
                    new_cols.append(col)
                    new_ids.append(token_id)
                count_slots.append(slot)
                count_cols.append(col)
            self.num_counted[request_id] = seq.num_output_tokens
            slot_of_row.append(slot)
            width = max(width, len(columns))
        self._reserve_width(width)
        if new_ids:
            index = (self._tensor(new_slots), self._tensor(new_cols))
            self.token_ids.index_put_(index, self._tensor(new_ids))
        if count_slots:
            index = (self._tensor(count_slots), self._tensor(count_cols))
            ones = torch.ones(len(count_slots), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(index, ones, accumulate=True)
        slots = self._tensor(slot_of_row)
        return PenaltyInputs(rows, self.token_ids[slots, :width], self.output_counts[slots, :width])

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            del self.num_counted[request_id]
            del self.columns[request_id]
            self.free_slots.append(slot)

    def check_integrity(self) -> None:
        used = set(self.slots.values())
        assert len(used) == len(self.slots), "two requests share a counts row"
        assert used.isdisjoint(self.free_slots), "a used counts row is also free"
        assert len(used) + len(self.free_slots) == self.token_ids.shape[0]
        assert self.slots.keys() == self.columns.keys() == self.num_counted.keys()
        assert all(len(cols) <= self.width for cols in self.columns.values())

    def _assign(self, seq: Sequence) -> int:
        if not self.free_slots:
            self._grow_slots()
        slot = self.free_slots.pop()
        distinct = list(dict.fromkeys(seq.prompt_token_ids))
        self._reserve_width(len(distinct))
        ids = self._tensor(distinct)
        self.token_ids[slot] = ids[0]  # the padding: repeats of the first seen token
        self.token_ids[slot, : len(distinct)] = ids
        self.output_counts[slot].zero_()
        self.slots[seq.request_id] = slot
        self.columns[seq.request_id] = {t: col for col, t in enumerate(distinct)}
        self.num_counted[seq.request_id] = 0
        return slot

    def _grow_slots(self) -> None:
        old = self.token_ids.shape[0]
        new = max(8, 2 * old)
        self.token_ids = torch.cat(
            [self.token_ids, self.token_ids.new_zeros(new - old, self.width)]
        )
        self.output_counts = torch.cat(
            [self.output_counts, self.output_counts.new_zeros(new - old, self.width)]
        )
        # Popped from the end: the lowest new slot is used first.
        self.free_slots.extend(range(new - 1, old - 1, -1))

    def _reserve_width(self, width: int) -> None:
        old = self.width
        if width <= old:
            return
        new = max(width, 2 * old, 16)
        rows = self.token_ids.shape[0]
        pad = self.token_ids[:, :1] if old else self.token_ids.new_zeros(rows, 1)
        self.token_ids = torch.cat([self.token_ids, pad.expand(rows, new - old)], dim=1)
        self.output_counts = torch.cat(
            [self.output_counts, self.output_counts.new_zeros(rows, new - old)], dim=1
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def apply_penalties(
    logits: torch.Tensor, params: Seq[SamplingParams], inputs: PenaltyInputs
) -> None:
    """Penalise ``logits`` ``[num_seqs, vocab]`` (float32) in place; ``params`` per row.

    Every token in ``inputs.token_ids`` is in its row's prompt or output, so all get the
    repetition penalty; tokens outside them are left as they are.
    """
    assert logits.is_contiguous()
    device = logits.device
    rows = torch.tensor(inputs.rows, device=device).unsqueeze(1)
    # Flat indices into the logits: take/scatter_ on them beat 2-D advanced indexing.
    flat = inputs.token_ids + rows * logits.shape[-1]
    seen = logits.take(flat)
    chosen = [params[i] for i in inputs.rows]
    counts = inputs.output_counts
    # One host-to-device copy for the three coefficients of every row.
    coef = torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in chosen],
        device=device,
    )
    if any(p.repetition_penalty != 1.0 for p in chosen):
        r = coef[:, 0:1]
        # transformers' form: negative logits are multiplied, the rest (0 included) divided.
        seen = torch.where(seen < 0, seen * r, seen / r)
    if any(p.frequency_penalty != 0.0 for p in chosen):
        seen -= coef[:, 1:2] * counts
    if any(p.presence_penalty != 0.0 for p in chosen):
        seen -= coef[:, 2:3] * (counts > 0)
    logits.view(-1).scatter_(0, flat.flatten(), seen.flatten())  # repeats write equal values


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
