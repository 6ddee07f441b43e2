"""Structured outputs: a per-sequence grammar matcher (``xgrammar``) masks the sampler's logits.

A :class:`~blendkv.sampling_params.StructuredOutputsParams` is compiled to an ``xgrammar``
grammar (JSON schema, any JSON object, regex, or a choice of strings). The engine's
:class:`StructuredOutputs` keeps one matcher per sequence (the samples of an ``n > 1`` request
are sequences of their own, each with its own matcher from its first token); before sampling
it fills one bitmask row per constrained sequence (the tokens the grammar allows next, EOS once
it is complete), the sampler masks the other tokens to -inf, and every sampled token then
advances its matcher. Logprobs stay those of the unmasked distribution (vLLM's default).

xgrammar was chosen over llguidance and outlines-core by its steady per-step mask cost on a
49K vocabulary and its CPU-only install (see docs/benchmarks.md).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING

from blendkv.errors import InvalidSamplingParamsError

if TYPE_CHECKING:
    import torch

    from blendkv.engine.sequence import Sequence
    from blendkv.sampling_params import StructuredOutputsParams

# Compiled grammars kept (an LRU keyed by the constraint's text).
_CACHE_SIZE = 64


def _grammar(spec: StructuredOutputsParams):
    import xgrammar as xgr

    if spec.json is not None:
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        # Compact JSON (no free whitespace): a model cannot wander into endless blanks.
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    if spec.json_object:
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.regex is not None:
        return xgr.Grammar.from_regex(spec.regex)
    assert spec.choice is not None
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")


def _field(spec: StructuredOutputsParams) -> str:
    for name in ("json", "regex", "choice"):
        if getattr(spec, name) is not None:
            return name
    return "json_object"


def check_grammar(spec: StructuredOutputsParams):
    """Compile ``spec``'s grammar (tokenizer-free); a bad schema or regex raises
    :class:`InvalidSamplingParamsError` naming the field."""
    name = _field(spec)
    try:
        if isinstance(spec.json, str):
            json.loads(spec.json)
        return _grammar(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidSamplingParamsError(
            f"SamplingParams.structured_outputs.{name} is not a valid {name}: {detail}"
        ) from e


class StructuredOutputs:
    """The engine's matchers: one per constrained sequence, keyed by request id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._compiler = None
        self._vocab_size = 0
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self.matchers: dict[str, object] = {}
        self._stop_ids: list[int] = []

    def _compile(self, spec: StructuredOutputsParams):
        compiled = self._compiled.get(spec.key)
        if compiled is None:
            compiled = self._compiler.compile_grammar(_grammar(spec))
            self._compiled[spec.key] = compiled
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(spec.key)
        return compiled

    def _matcher(self, seq: Sequence):
        import xgrammar as xgr

        m = self.matchers.get(seq.request_id)
        if m is None:
            m = xgr.GrammarMatcher(self._compile(seq.sampling_params.structured_outputs))
            # A preempted sequence keeps its output: replay it (normally nothing to replay).
            for t in seq.output_token_ids:
                assert m.accept_token(t), f"token {t} was sampled under this grammar's mask"
            self.matchers[seq.request_id] = m
        return m

    def bitmask(
        self, seqs: list[Sequence], vocab_size: int, device
    ) -> tuple[torch.Tensor, list[int]] | None:
        """``(bitmask [rows, ceil(vocab/32)] int32 on device, rows)`` for the constrained
        sequences among ``seqs`` (bit t of a row: token t allowed), None when there are none."""
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.structured_outputs]
        if not rows:
            return None
        import xgrammar as xgr

        if self._compiler is None or self._vocab_size != vocab_size:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
            self._stop_ids = [t for t in info.stop_token_ids if 0 <= t < vocab_size]
            self._vocab_size = vocab_size
            self._compiled.clear()
        mask = xgr.allocate_token_bitmask(len(rows), vocab_size)
        for j, i in enumerate(rows):
            m = self._matcher(seqs[i])
            if m.is_terminated():  # EOS taken but the request goes on (min_tokens): EOS only
                mask[j] = 0
                for t in self._stop_ids:
                    mask[j, t // 32] |= _bit(t % 32)
            else:
                m.fill_next_token_bitmask(mask, j)
        return mask.to(device), rows

    def accept(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Advance the matchers of the constrained sequences by their sampled tokens."""
        for seq, t in zip(seqs, token_ids, strict=True):
            m = self.matchers.get(seq.request_id)
            if m is not None and not m.is_terminated():
                m.accept_token(t)

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)


def _bit(k: int) -> int:
    """Bit ``k`` of an int32 word as a Python int in int32's range."""
    return (1 << k) - (1 << 32 if k == 31 else 0)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[rows[j], t]`` to -inf where bit t of ``bitmask[j]`` is 0 (in place,
    vectorised: the int32 words are unpacked with shifts)."""
    import torch

    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32], little-endian bits
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
