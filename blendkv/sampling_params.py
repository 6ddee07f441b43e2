"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

A ``SamplingParams`` is frozen: the engine reads it and never mutates it. Every field is validated
in ``__post_init__``; a bad value raises :class:`~blendkv.errors.InvalidSamplingParamsError`
naming the parameter, the value and the allowed range. Some fields are normalised on the way in:
``stop`` becomes a ``list[str]``, ``stop_token_ids`` a ``list[int]`` and ``logit_bias`` a
``dict[int, float]`` (all empty when None), and ``top_k=-1`` becomes ``0`` (both mean
"disabled"). Penalties and ``logit_bias`` follow vLLM (and the OpenAI API); token ids in
``logit_bias`` are checked against the model's vocabulary when the request is added.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

from blendkv.errors import InvalidSamplingParamsError

# Temperatures below this are treated as greedy: dividing logits by them overflows float32.
_SAMPLING_EPS = 1e-5
# Upper bound on ``logprobs`` (the number of top alternatives returned per token), as in vLLM.
MAX_LOGPROBS = 20
# OpenAI's (and vLLM's) ranges for the additive penalties and the logit bias.
_MAX_PENALTY = 2.0
_MAX_LOGIT_BIAS = 100.0
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_INT64_MAX = 2**63 - 1  # top_k goes into a torch.long tensor


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _bad(name: str, value: object, allowed: str) -> InvalidSamplingParamsError:
    return InvalidSamplingParamsError(f"SamplingParams.{name} must be {allowed}; got {value!r}")


def _check_float(name: str, value: object, allowed: str, ok) -> float:
    # bool is an int subclass; True where a number is expected is almost always a bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(name, value, allowed)
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise _bad(name, value, allowed)
    return value


def _within(bound: float):
    return lambda v: -bound <= v <= bound


def _check_int(name: str, value: object, allowed: str, ok) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _bad(name, value, allowed)
    value = int(value)
    if not ok(value):
        raise _bad(name, value, allowed)
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, value, "a bool (True or False)")
    return value


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's ``StructuredOutputsParams``); exactly one field is set.

    The constraint is compiled (``xgrammar``) on construction, so a bad schema or regex raises
    :class:`~blendkv.errors.InvalidSamplingParamsError` here, not in the engine.

    Attributes:
        json: a JSON schema (a dict or its JSON text); the output is JSON valid against it.
        json_object: True: the output is any JSON object (``response_format`` ``json_object``).
        regex: the output matches this regular expression.
        choice: the output is exactly one of these strings.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        set_fields = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
            )
            if value is not None
        ]
        if len(set_fields) != 1:
            raise InvalidSamplingParamsError(
                "StructuredOutputsParams needs exactly one of json, json_object, regex, choice; "
                f"got {set_fields or 'none'}"
            )
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise _bad("structured_outputs.choice", self.choice, "a list of non-empty str")
            object.__setattr__(self, "choice", list(self.choice))
        if self.regex is not None and not isinstance(self.regex, str):
            raise _bad("structured_outputs.regex", self.regex, "a str")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise _bad("structured_outputs.json", self.json, "a JSON schema (dict or str)")
        from blendkv.engine.structured_output import check_grammar

        check_grammar(self)

    @property
    def key(self) -> str:
        """A canonical text of the constraint (the compiled-grammar cache key)."""
        import json

        return json.dumps(
            [self.json, self.json_object, self.regex, self.choice], sort_keys=True, default=str
        )


@dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens and when to stop.

    The sampler applies ``logit_bias``, then the penalties, then temperature and the filters;
    greedy requests get the bias and the penalties too. The default ``max_tokens`` is 16
    (vLLM's); pass more for longer answers.

    Attributes:
        temperature: 0 (or below 1e-5) means greedy (argmax); otherwise logits are divided by
            it.
        top_p: nucleus sampling; keep the smallest set of tokens whose probability sums to >=
            top_p.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's
            probability.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token the request has
            generated so far (output tokens only, as in OpenAI and vLLM).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time the
            request has generated it (output tokens only).
        repetition_penalty: > 0; the logit of every token in the prompt or the output is
            divided by it when positive and multiplied by it when negative (transformers' and
            vLLM's ``repetition_penalty``); 1 disables.
        logit_bias: ``{token_id: bias}``, bias in [-100, 100], added to those tokens' logits.
        seed: per-request seed; the same seed gives the same tokens whatever else is in the
            batch.
        max_tokens: cap on output tokens; None means "until max_model_len".
        min_tokens: EOS, stop token ids and stop strings are ignored until this many tokens
            exist.
        stop: stop strings; the output text ends before the first one (after it with
            ``include_stop_str_in_output``).
        stop_token_ids: token ids that end the request like EOS (but also under
            ``ignore_eos``).
        ignore_eos: keep generating after the EOS token.
        logprobs: None returns no logprobs; n >= 0 returns the chosen token's logprob and the
            n most likely tokens' logprobs, all from the unmodified model distribution (before
            ``logit_bias``, penalties, temperature and the filters: vLLM's default).
        include_stop_str_in_output: keep the matched stop string (or stop token text) in the
            text.
        skip_special_tokens: leave special tokens out of the detokenized text.
        n: output sequences (samples) per request, each a ``CompletionOutput`` (``index``
            0..n-1). The prompt is computed once and its KV blocks shared; with a ``seed``,
            sample i uses ``seed + i`` (vLLM's convention). Greedy samples are all equal.
        structured_outputs: constrain the output to a JSON schema, any JSON object, a regex or
            one of a list of strings (:class:`StructuredOutputsParams`); each sample of
            ``n > 1`` keeps its own grammar state.
        prompt_logprobs: None, or k >= 0: ``RequestOutput.prompt_logprobs`` holds, per prompt
            token after the first, its logprob and the k most likely tokens' (vLLM's
            extension). The prompt is then computed in full (no prefix-cache hit); blended
            prompts refuse it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # In this order: with several bad values, the first one checked here is reported.
        self._check_sampling()
        self._check_penalties()
        self._check_seed()
        self._check_lengths()
        self._check_stops()
        self._check_outputs()

    def _put(self, name: str, value: object) -> None:
        # Frozen dataclass: normalised values are written with object.__setattr__.
        object.__setattr__(self, name, value)

    def _check_sampling(self) -> None:
        """temperature and the filters (top_p, top_k, min_p); top_k -1 becomes 0."""
        self._put(
            "temperature",
            _check_float("temperature", self.temperature, "a finite float >= 0", lambda v: v >= 0),
        )
        self._put(
            "top_p", _check_float("top_p", self.top_p, "a float in (0, 1]", lambda v: 0 < v <= 1)
        )
        allowed = "an int in [-1, 2**63) (0 or -1 disable)"
        top_k = _check_int("top_k", self.top_k, allowed, lambda v: -1 <= v <= _INT64_MAX)
        self._put("top_k", max(top_k, 0))
        self._put(
            "min_p", _check_float("min_p", self.min_p, "a float in [0, 1]", lambda v: 0 <= v <= 1)
        )

    def _check_penalties(self) -> None:
        """The additive and the repetition penalties, and logit_bias."""
        for name in ("presence_penalty", "frequency_penalty"):
            allowed = f"a float in [-{_MAX_PENALTY:g}, {_MAX_PENALTY:g}]"
            value = _check_float(name, getattr(self, name), allowed, _within(_MAX_PENALTY))
            self._put(name, value)
        self._put(
            "repetition_penalty",
            _check_float(
                "repetition_penalty",
                self.repetition_penalty,
                "a finite float > 0 (1 disables)",
                lambda v: v > 0,
            ),
        )
        self._put("logit_bias", self._normalise_logit_bias(self.logit_bias))

    def _check_seed(self) -> None:
        if self.seed is not None:
            self._put(
                "seed",
                _check_int(
                    "seed",
                    self.seed,
                    "None or an int in [-2**63, 2**64)",
                    lambda v: _SEED_MIN <= v <= _SEED_MAX,
                ),
            )

    def _check_lengths(self) -> None:
        """max_tokens and min_tokens, each alone and min_tokens <= max_tokens."""
        if self.max_tokens is not None:
            self._put(
                "max_tokens",
                _check_int("max_tokens", self.max_tokens, "None or an int >= 1", lambda v: v >= 1),
            )
        self._put(
            "min_tokens", _check_int("min_tokens", self.min_tokens, "an int >= 0", lambda v: v >= 0)
        )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")

    def _check_stops(self) -> None:
        self._put("stop", self._normalise_stop(self.stop))
        self._put("stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids))

    def _check_outputs(self) -> None:
        """What comes back: n samples, the bool flags, logprobs and the output constraint."""
        self._put("n", _check_int("n", self.n, "an int >= 1", lambda v: v >= 1))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        logprobs_allowed = f"None or an int in [0, {MAX_LOGPROBS}]"
        if self.prompt_logprobs is not None:
            self._put(
                "prompt_logprobs",
                _check_int(
                    "prompt_logprobs",
                    self.prompt_logprobs,
                    logprobs_allowed,
                    lambda v: 0 <= v <= MAX_LOGPROBS,
                ),
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise _bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
        if self.logprobs is not None:
            self._put(
                "logprobs",
                _check_int(
                    "logprobs", self.logprobs, logprobs_allowed, lambda v: 0 <= v <= MAX_LOGPROBS
                ),
            )

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        allowed = "None, a non-empty str or a list of non-empty str"
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise _bad("stop", stop, allowed)
        for s in items:
            if not isinstance(s, str) or not s:
                raise _bad("stop", stop, allowed)
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        allowed = "None or a list of ints >= 0"
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise _bad("stop_token_ids", ids, allowed)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
                raise _bad("stop_token_ids", ids, allowed)
        return [int(i) for i in ids]

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float]:
        allowed = (
            f"None or a dict of token id (an int >= 0) -> bias (a float in "
            f"[-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}])"
        )
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise _bad("logit_bias", bias, allowed)
        out: dict[int, float] = {}
        for token_id, value in bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                raise _bad("logit_bias", bias, allowed)
            if token_id < 0:
                raise _bad("logit_bias", bias, allowed)
            value_allowed = f"a float in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]"
            out[int(token_id)] = _check_float(
                f"logit_bias[{token_id}]", value, value_allowed, _within(_MAX_LOGIT_BIAS)
            )
        return out

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs this request's prompt and output token counts."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are picked by argmax (``temperature`` below 1e-5)."""
        return self.temperature < _SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        """``GREEDY``, ``RANDOM`` or ``RANDOM_SEED`` (a ``seed`` is set): how the sampler
        batches this request."""
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED
