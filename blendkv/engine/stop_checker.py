"""Decides, after each generated token, whether a request is finished (pure Python).

Call it after the token's text delta is appended to ``output_text``. First match wins:

1. fewer than ``min_tokens`` output tokens: only the ``length`` cap applies;
2. EOS (unless ``ignore_eos``)                            -> "stop", stop_reason None;
3. a token in ``stop_token_ids``                          -> "stop", stop_reason = the id;
4. a stop string in the text the new token added          -> "stop", stop_reason = the string;
5. ``num_output_tokens >= max_output_tokens``             -> "length".

Text: 2-3 cut the stop token's delta; 4 cuts before the earliest stop string (after it with
``include_stop_str_in_output``). Streaming holds back the last :func:`stop_holdback_len` chars
(``max_stop_str_len - 1``; 0 without stop strings or when they are kept), which might begin a
stop string split over tokens; the rest is sent on finish.
"""

from __future__ import annotations

from typing import NamedTuple

from blendkv.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class StopResult(NamedTuple):
    """finish_reason: "stop", "length" or None (keep going).

    stop_reason: the matched stop string or stop token id; None for EOS, length or running.
    truncate_text_to: when not None, the caller sets ``output_text = output_text[:n]``.
    """

    finish_reason: str | None
    stop_reason: str | int | None
    truncate_text_to: int | None


_RUNNING = StopResult(None, None, None)


def max_stop_str_len(params: SamplingParams) -> int:
    """Length in characters of the longest stop string (0 without stop strings)."""
    return max((len(s) for s in params.stop), default=0)


def stop_holdback_len(params: SamplingParams) -> int:
    """Characters at the end of a running request's text to hold back from a stream."""
    if params.include_stop_str_in_output:
        return 0
    return max(max_stop_str_len(params) - 1, 0)


def check_stop(
    *,
    new_token_id: int,
    num_output_tokens: int,
    output_text: str,
    new_text_len: int,
    params: SamplingParams,
    eos_token_id: int | None,
    max_output_tokens: int,
) -> StopResult:
    """Check whether the request stops after ``new_token_id``.

    num_output_tokens: output tokens so far, including ``new_token_id``.
    output_text: the output text so far, including the new token's delta.
    new_text_len: length in characters of that delta (the only region searched for new stop
        strings, widened by the longest stop string minus one to catch strings split across
        tokens).
    max_output_tokens: the effective cap: ``min(params.max_tokens, max_model_len - prompt_len)``.
    """
    assert 0 <= new_text_len <= len(output_text), (new_text_len, len(output_text))
    length_hit = num_output_tokens >= max_output_tokens
    if num_output_tokens < params.min_tokens:
        return StopResult(FINISH_LENGTH, None, None) if length_hit else _RUNNING

    # Stop tokens' own text is excluded unless asked for (like vLLM); with
    # skip_special_tokens it is usually empty anyway.
    token_cut = None
    if new_text_len and not params.include_stop_str_in_output:
        token_cut = len(output_text) - new_text_len
    if not params.ignore_eos and eos_token_id is not None and new_token_id == eos_token_id:
        return StopResult(FINISH_STOP, None, token_cut)
    if new_token_id in params.stop_token_ids:
        return StopResult(FINISH_STOP, new_token_id, token_cut)

    if params.stop and new_text_len:
        hit = _find_stop_str(output_text, new_text_len, params)
        if hit is not None:
            start, stop_str = hit
            end = start + len(stop_str) if params.include_stop_str_in_output else start
            return StopResult(FINISH_STOP, stop_str, end)

    return StopResult(FINISH_LENGTH, None, None) if length_hit else _RUNNING


def _find_stop_str(output_text: str, new_text_len: int, params: SamplingParams):
    """Earliest ``(index, stop_str)`` among matches that end inside the new text, or None.

    Each string is searched from ``len(stop_str) - 1`` characters before the new text: a match
    starting earlier ended before the new text and was there last step (or under min_tokens).
    """
    new_text_start = len(output_text) - new_text_len
    best = None
    for stop_str in params.stop:
        index = output_text.find(stop_str, max(new_text_start - len(stop_str) + 1, 0))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    return best
