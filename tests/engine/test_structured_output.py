"""Structured outputs through ``LLM.generate``: the grammar mask guarantees the shape of the
output even from a random-weight model (json_schema, json_object, choice, regex), per sample of
``n > 1``; a bad schema is refused when the params are built."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.engine.structured_output import apply_bitmask
from blendkv.errors import InvalidSamplingParamsError
from blendkv.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return QuietLLM(str(tiny_llama_dir), device="cpu", dtype="float32")


def _gen(llm, spec: StructuredOutputsParams, **kw) -> list[str]:
    params = SamplingParams(structured_outputs=spec, max_tokens=48, **kw)
    out = llm.generate(["Tell me about Paris."], params)[0]
    return [c.text for c in out.outputs], [c.finish_reason for c in out.outputs]


def test_json_schema_output_validates(llm):
    texts, reasons = _gen(llm, StructuredOutputsParams(json=SCHEMA), temperature=1.0, seed=3, n=3)
    for text, reason in zip(texts, reasons, strict=True):
        value = json.loads(text)
        assert set(value) == {"city", "ok", "n"} and reason == "stop"
        assert value["city"] in {"Paris", "Berlin", "Tokyo"} and isinstance(value["ok"], bool)
        assert isinstance(value["n"], int) and 0 <= value["n"] <= 9


def test_unconstrained_output_is_not_json(llm):
    # The mask is what makes the outputs above valid: without it this model writes noise.
    out = llm.generate(["Tell me about Paris."], SamplingParams(max_tokens=24, temperature=0))
    with pytest.raises(ValueError):
        json.loads(out[0].outputs[0].text)


def test_json_object_output_parses(llm):
    tok = llm.tokenizer
    close = tok.encode("}", add_special_tokens=False)
    # A bias toward "}" lets the random model close the object within max_tokens.
    texts, _ = _gen(
        llm,
        StructuredOutputsParams(json_object=True),
        temperature=0,
        logit_bias={close[0]: 30.0},
    )
    assert isinstance(json.loads(texts[0]), dict)


def test_choice_and_regex(llm):
    choices = ["red apple", "green pear", 'say "hi"']
    texts, reasons = _gen(llm, StructuredOutputsParams(choice=choices), temperature=1.0, n=4)
    assert all(t in choices for t in texts) and set(reasons) == {"stop"}
    texts, _ = _gen(llm, StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{2}"), temperature=0)
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", texts[0])


def test_a_complete_grammar_ends_even_below_min_tokens(llm):
    texts, reasons = _gen(llm, StructuredOutputsParams(choice=["yes", "no"]), min_tokens=8)
    assert texts[0] in ("yes", "no") and reasons == ["stop"]


@pytest.mark.parametrize(
    "kwargs",
    [dict(json="{not json"), dict(json={"type": "nonsense"}), dict(regex="(("), dict(choice=[])],
)
def test_bad_constraint_is_refused(kwargs):
    with pytest.raises(InvalidSamplingParamsError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_apply_bitmask_keeps_exactly_the_set_bits():
    vocab = 70
    allowed = [0, 5, 31, 32, 63, 69]
    words = torch.zeros(1, 3, dtype=torch.int32)
    for t in allowed:
        words[0, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    logits = torch.randn(2, vocab)
    before = logits.clone()
    apply_bitmask(logits, words, [1])
    assert torch.equal(logits[0], before[0])
    kept = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert kept == allowed and torch.equal(logits[1, allowed], before[1, allowed])
