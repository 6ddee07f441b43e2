"""``blendkv ask --show-prompt --compare-full [--json]``: the assembled prompt with its pieces
marked, and full prefill beside the blend (answers, TTFTs, teacher-forced answer KL)."""

from __future__ import annotations

import json
import math
import re

import pytest
from helpers import QUIET_FLAGS, QuietLLM
from rag_helpers import DEMO_DOCS

from blendkv import SamplingParams
from blendkv.cli import main
from blendkv.rag import RAGPipeline
from blendkv.rag.pipeline import DEFAULT_INSTRUCTION

pytestmark = pytest.mark.slow
QUESTION = "Who created Python?"


@pytest.fixture(scope="module")
def store_args(tiny_llama_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("explain") / "store"
    args = ["--store", str(store), "--model", str(tiny_llama_dir), "--dtype", "float32"]
    args += QUIET_FLAGS
    assert main(["ingest", str(DEMO_DOCS), "--chunk-tokens", "64", "--no-progress", *args]) == 0
    return args


def ask_json(capsys, args, *flags) -> dict:
    capsys.readouterr()
    argv = ["ask", QUESTION, "--top-k", "2", "--max-tokens", "6", "--json", *flags, *args]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_show_prompt_and_compare_full_json(store_args, tiny_llama_dir, capsys):
    record = ask_json(capsys, store_args, "--show-prompt", "--compare-full")
    prompt, sources = record["prompt"], record["sources"]
    segments = prompt["segments"]
    n = record["blend_stats"]["num_prompt_tokens"]
    # Every token exactly once, in order; the pieces are the ones the prompt was built from.
    assert segments[0]["start"] == 0 and segments[-1]["end"] == prompt["num_tokens"] == n
    assert all(a["end"] == b["start"] for a, b in zip(segments, segments[1:], strict=False))
    assert [s["kind"] for s in segments] == ["template", "instruction", "chunk", "chunk", "query"]
    chunks = [s for s in segments if s["kind"] == "chunk"]
    assert [c["chunk_id"] for c in chunks] == [s["chunk_id"] for s in sources]
    assert [c["text"] for c in chunks] == [s["text"] for s in sources]
    assert [c["source"] for c in chunks] == [s["source"] for s in sources]
    assert all(c["source"].endswith((".md", ".txt")) for c in chunks)  # the files, not doc ids
    assert segments[1]["text"] == DEFAULT_INSTRUCTION
    assert QUESTION in segments[-1]["text"]

    cmp = record["compare_full"]
    assert cmp["num_prompt_tokens"] == n and cmp["scored_tokens"] == 6
    assert cmp["blend"]["answer"] == record["answer"]  # greedy both times
    assert cmp["full"]["ttft_s"] > 0 and cmp["blend"]["ttft_s"] > 0
    assert cmp["answer_kl"] >= 0 and 0 <= cmp["answer_agreement"] <= 1
    # Full prefill's answer is the plain engine's greedy answer on the same prompt tokens.
    with QuietLLM(str(tiny_llama_dir), dtype="float32") as llm:
        with RAGPipeline(store_args[1], llm=llm, create=False) as rag:
            prompt = rag.blended_prompt(QUESTION, rag.order_sources(rag.retrieve(QUESTION, 2)))
            assert prompt["chunk_ids"] == [s["chunk_id"] for s in sources]
            ids = rag.manager.prepare(prompt, None).prompt.token_ids
            assert len(ids) == n
            [full] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=6))
    assert cmp["full"]["answer"] == full.text.strip()


def test_answer_kl_is_zero_at_ratio_one_and_positive_with_full_reuse(store_args, capsys):
    exact = ask_json(capsys, store_args, "--compare-full", "--ratio", "1.0")["compare_full"]
    assert exact["answer_kl"] < 1e-6 and exact["answer_agreement"] == 1.0
    assert exact["blend"]["answer"] == exact["full"]["answer"]
    reuse = ask_json(capsys, store_args, "--compare-full", "--ratio", "0.0")["compare_full"]
    assert reuse["full"]["answer"] == exact["full"]["answer"]
    assert reuse["answer_kl"] > 1e-3 and math.isfinite(reuse["answer_kl"])
    plain = ask_json(capsys, store_args)
    assert "prompt" not in plain and "compare_full" not in plain


def test_text_output(store_args, capsys):
    capsys.readouterr()
    argv = ["ask", QUESTION, "--top-k", "2", "--max-tokens", "4", "--show-prompt"]
    assert main([*argv, "--compare-full", *store_args]) == 0
    out = capsys.readouterr().out
    for marker in (
        "=== template",
        "=== instruction",
        "=== chunk 1/2",
        "=== chunk 2/2",
        "=== query",
    ):
        assert marker in out
    assert "answer KL" in out and "full prefill" in out
    assert "blend@0.3 (target 1 nats)" in out  # the default target, uncalibrated: 0.3 ran
    # The stats line's parts add up to the prompt.
    [line] = [x for x in out.splitlines() if "prompt tokens =" in x]
    numbers = [int(v) for v in re.findall(r"(\d+) (?:prompt tokens|reused|others)", line)]
    assert numbers[0] == sum(numbers[1:]) and "reused as stored" in line


def test_verify_checks_the_answer_against_full_prefill(store_args, capsys):
    record = ask_json(capsys, store_args, "--verify", "--ratio", "1.0")
    v = record["blend_stats"]["verification"]
    assert v["same_answer"] and v["blend_answer"] == record["answer"]
    assert v["max_kl"] < 1e-4 and v["scored_tokens"] >= 1
    capsys.readouterr()
    argv = ["ask", QUESTION, "--top-k", "2", "--max-tokens", "6", "--verify", *store_args]
    assert main([*argv, "--ratio", "0"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("verified: ") and "KL(full || blend) max" in line
