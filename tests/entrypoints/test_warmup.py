"""The warm-up request at load: it runs a prefill and a decode step (and the chunk-packing
probe), leaves no trace (block pool, prefix cache, request ids, outputs), and can be switched
off."""

from __future__ import annotations

import pytest
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.entrypoints.warmup import WARMUP_PROMPT_TOKENS, warm_up

PROMPTS = ["The quick brown fox", "Paris is the capital of"]
BLENDED = {"documents": ["Paris is the capital of France. " * 3], "query": "Capital?"}


def _forward_rows(llm) -> list[int]:
    """Rows of every model forward from now on (a hook on the model)."""
    rows: list[int] = []
    llm.engine.model.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-1]))
    return rows


def test_warm_up_runs_a_prefill_and_a_decode_step(tiny_llama_dir):
    with QuietLLM(str(tiny_llama_dir), dtype="float32", warmup=False) as llm:
        rows = _forward_rows(llm)
        assert llm.engine.runner.pack_rows is None
        assert warm_up(llm.engine) > 0
        assert rows[:2] == [WARMUP_PROMPT_TOKENS, 1]
        # then the chunk-packing probe's forwards: decided here, not in a live step
        assert len(rows) > 2 and llm.engine.runner.pack_rows is not None
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks == 0
        assert list(bm.free_queue) == list(range(bm.num_blocks))  # as a fresh pool
        assert llm.engine.scheduler.block_manager is bm
        assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_warm_engine_answers_as_a_cold_one(tiny_llama_dir):
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    outputs = []
    for warmup in (False, True):
        with QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4, warmup=warmup) as llm:
            first = llm.generate(PROMPTS, greedy)
            again = llm.generate(PROMPTS, greedy)  # the prefix cache holds only these prompts
            blended = llm.generate([BLENDED], greedy, blend=BlendConfig())[0]
            sampled = llm.generate(PROMPTS, seeded)
            outputs.append(
                (
                    [o.request_id for o in first],
                    [o.outputs[0].token_ids for o in first + again + sampled],
                    [o.outputs[0].logprobs for o in first],
                    [o.metrics.num_cached_tokens for o in first + again],
                    blended.outputs[0].token_ids,
                    blended.blend_stats.describe(),
                )
            )
    assert outputs[0] == outputs[1]
    assert outputs[1][0] == ["0", "1"]


def test_switch_is_config(tiny_llama_dir):
    """``warmup`` (``--warmup/--no-warmup``) runs the warm-up request at load, or not."""
    from blendkv.cli import build_parser, engine_kwargs

    for warmup in (True, False):
        with QuietLLM(str(tiny_llama_dir), dtype="float32", warmup=warmup) as llm:
            assert (llm.engine.stats().num_generated_tokens > 0) == warmup
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["generate", "x"]))["warmup"] is True
    assert engine_kwargs(parser.parse_args(["generate", "x", "--no-warmup"]))["warmup"] is False


@pytest.mark.parametrize(("backend", "expected"), [("cpu", True), ("triton", False)])
def test_nothing_to_warm_under_the_triton_interpreter(tiny_llama_dir, backend, expected):
    with QuietLLM(
        str(tiny_llama_dir), dtype="float32", attention_backend=backend, warmup=False
    ) as llm:
        rows = _forward_rows(llm)
        took = warm_up(llm.engine)
        assert (took > 0, bool(rows)) == (expected, expected)
