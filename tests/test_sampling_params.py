from __future__ import annotations

import dataclasses
import math

import pytest

from blendkv.errors import InvalidRequestError, InvalidSamplingParamsError
from blendkv.sampling_params import SamplingParams, SamplingType

INVALID = [
    ("temperature", -0.1),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", "1.0"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -1.0),
    ("top_p", None),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", math.nan),
    ("seed", 1.5),
    ("seed", True),
    ("seed", 2**64),
    ("seed", "42"),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 3.0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", False),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", 3),
    ("stop", {"a"}),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", [1, True]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("include_stop_str_in_output", None),
    ("skip_special_tokens", 0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
    ("logprobs", 1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("presence_penalty", None),
    ("frequency_penalty", 3),
    ("frequency_penalty", "1"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("logit_bias", [1, 2]),
    ("logit_bias", {"3": 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {True: 1.0}),
    ("logit_bias", {3.0: 1.0}),
    ("n", 0),
    ("n", -2),
    ("n", 1.5),
    ("n", True),
]


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_invalid_value_rejected_with_parameter_named(name, value):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert name in message
    assert repr(value) in message or str(value) in message
    assert isinstance(info.value, InvalidRequestError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("bias", [100.5, -101, math.inf, math.nan, "1", None])
def test_logit_bias_value_out_of_range_names_the_token(bias):
    with pytest.raises(InvalidSamplingParamsError, match=r"logit_bias\[7\] must be a float in "):
        SamplingParams(logit_bias={3: 1.0, 7: bias})


def test_penalties_and_logit_bias_normalised():
    p = SamplingParams()
    assert p.presence_penalty == p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
    assert p.logit_bias == {} and not p.has_penalties
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, logit_bias={5: -100, 6: 100})
    assert isinstance(p.presence_penalty, float) and p.logit_bias == {5: -100.0, 6: 100.0}
    assert all(isinstance(v, float) for v in p.logit_bias.values())
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert not SamplingParams(logit_bias={1: 5.0}).has_penalties  # a bias needs no counts


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(InvalidSamplingParamsError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=5)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.min_p == 0.0
    assert p.max_tokens == 16 and p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.skip_special_tokens and not p.ignore_eos
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert isinstance(SamplingParams(temperature=0).temperature, float)
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(logprobs=20).logprobs == 20
    assert SamplingParams(seed=-1).seed == -1


def test_sampling_type():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-7).sampling_type == SamplingType.GREEDY
    assert not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(temperature=0.5).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.5, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_frozen_and_replace_revalidates():
    p = SamplingParams(temperature=0.3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0
    assert dataclasses.replace(p, top_k=5).top_k == 5
    with pytest.raises(InvalidSamplingParamsError, match="top_k"):
        dataclasses.replace(p, top_k=-5)
