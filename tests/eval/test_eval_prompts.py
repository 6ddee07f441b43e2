from __future__ import annotations

import dataclasses

import pytest

from blendkv.eval.datasets import Example, Passage
from blendkv.eval.prompts import (
    DEFAULT_PROMPTS,
    PromptSpec,
    RenderedPrompt,
    get_prompt_spec,
    normalize_question,
    render_prompt,
)

EXAMPLE = Example(
    "ex-0",
    "Where was the author of Hannibal and Scipio educated at?",
    ["Exeter College"],
    [Passage("", "hannibal and scipio is a play."), Passage("Nabbes", "He studied {at} Exeter.")],
)


def test_musique_prompt_matches_cacheblend_exactly():
    rendered = render_prompt(EXAMPLE, DEFAULT_PROMPTS["musique"])
    assert rendered == RenderedPrompt(
        system="You will be asked a question after reading several passages. Please directly "
        "answer the question based on the given passages. Do NOT repeat the question. The answer "
        "should be within 5 words..\nPassages:\n",
        documents=[
            "\n\nhannibal and scipio is a play.\n\n",
            "Nabbes\n\nHe studied {at} Exeter.\n\n",
        ],
        query="\n\nAnswer the question directly based on the given passages. Do NOT repeat the "
        "question. The answer should be within 5 words. \nQuestion:where was the author of "
        "Hannibal and Scipio educated at?\nAnswer:",
    )


def test_every_default_prompt_renders_one_document_per_passage():
    assert set(DEFAULT_PROMPTS) == {"musique", "synthetic", "longbench"}
    for kind, spec in DEFAULT_PROMPTS.items():
        system, documents, query = render_prompt(EXAMPLE, spec)
        assert len(documents) == 2, kind
        assert "Hannibal and Scipio educated at?" in query and query.endswith("Answer:"), kind
        assert "He studied {at} Exeter." in documents[1], kind  # braces in data stay literal
        assert system and not system.endswith(" "), kind
    assert render_prompt(EXAMPLE, DEFAULT_PROMPTS["synthetic"]).documents[1] == (
        "Nabbes\nHe studied {at} Exeter.\n\n"
    )
    assert get_prompt_spec("longbench") is DEFAULT_PROMPTS["longbench"]
    with pytest.raises(ValueError, match="no default prompt"):
        get_prompt_spec("samsum")


def test_prompt_spec_is_frozen_and_validated():
    spec = DEFAULT_PROMPTS["synthetic"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.system = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        DEFAULT_PROMPTS["new"] = spec  # type: ignore[index]
    with pytest.raises(ValueError, match="passage_template"):
        PromptSpec("s", "{title}", "{question}")
    with pytest.raises(ValueError, match="passage_template"):
        PromptSpec("s", "{text} {source}", "{question}")
    with pytest.raises(ValueError, match="query_template"):
        PromptSpec("s", "{text}", "Q: {query}")
    assert render_prompt(EXAMPLE, PromptSpec("", "<{text}>", "{{{question}}}")).query == (
        "{Where was the author of Hannibal and Scipio educated at?}"
    )


def test_normalize_question():
    assert normalize_question("Who wrote it") == "who wrote it?"
    assert normalize_question(" Who wrote it? ") == "who wrote it?"
    assert normalize_question("") == ""
