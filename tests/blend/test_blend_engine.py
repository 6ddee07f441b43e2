"""Blending inside the serving engine: mixed batches, the store, the prefix cache, bad input."""

from __future__ import annotations

import pytest
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import QuietLLM

from blendkv import InvalidRequestError, SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.errors import ConfigError
from blendkv.store import FingerprintMismatchError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = {"documents": DOCS, "query": QUERY}
OTHER = {"documents": DOCS[::-1], "query": "Where does the fox jump?", "system": "Be brief."}
PLAIN = [[5, 6, 7, 8, 9, 10], [40, 41] * 9]


def run_alone(llm, prompt, blend=None):
    return llm.generate([prompt], GREEDY, blend=blend)[0].outputs[0].token_ids


def test_mixed_batch_equals_each_request_alone(tiny_llama_dir):
    """Blended (two configs) + plain prefills + a request already decoding, in one step."""
    # Without reads ahead: a blended request whose chunks are still being read would let the
    # plain requests pass it (tests/blend/test_prefetch.py covers that), and the step's layout
    # would depend on the reader thread's timing.
    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        prefetch_kv=False,
    )
    configs = [
        BlendConfig(recompute_ratio=0.3),
        BlendConfig(recompute_ratio=0.6, selection="attention"),
    ]
    alone = {
        "b0": run_alone(llm, PROMPT, configs[0]),
        "b1": run_alone(llm, OTHER, configs[1]),
        "p0": run_alone(llm, PLAIN[0]),
        "p1": run_alone(llm, PLAIN[1]),
    }
    engine = llm.engine
    steps = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append(sorted((s.request_id, n > 1) for s, n in out.scheduled))
        return out

    engine.scheduler.schedule = recording_schedule
    engine.add_request(PLAIN[0], GREEDY, request_id="p0")
    engine.step()
    engine.step()  # p0 is decoding now
    engine.add_request(PROMPT, GREEDY, request_id="b0", blend=configs[0])
    engine.add_request(OTHER, GREEDY, request_id="b1", blend=configs[1])
    engine.add_request(PLAIN[1], GREEDY, request_id="p1")
    results = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o.outputs[0].token_ids
        engine.check_integrity()
    # One step held p0's decode, both fused prefills and the plain prefill.
    assert steps[2] == [("b0", True), ("b1", True), ("p0", False), ("p1", True)]
    assert results == alone
    llm.close()


def test_store_round_trip_after_reopen(tiny_llama_dir, tmp_path):
    cfg = BlendConfig(recompute_ratio=0.2)
    store = tmp_path / "store"
    with QuietLLM(
        str(tiny_llama_dir), dtype="float32", block_size=4, kv_store_dir=str(store)
    ) as llm:
        fresh = llm.generate([PROMPT], GREEDY, blend=cfg)[0]
        assert fresh.blend_stats.chunks_missed == 3 and fresh.blend_stats.chunks_hit == 0
    with QuietLLM(
        str(tiny_llama_dir), dtype="float32", block_size=4, kv_store_dir=str(store)
    ) as llm:
        again = llm.generate([PROMPT], GREEDY, blend=cfg)[0]
        stats = again.blend_stats
        assert stats.chunks_hit == 3 and stats.chunks_missed == 0
        assert stats.kv_bytes_loaded > 0
        assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_store_for_another_model_is_refused(tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    store = tmp_path / "store"
    with QuietLLM(str(tiny_llama_dir), dtype="float32", kv_store_dir=str(store)) as llm:
        llm.generate([PROMPT], GREEDY, blend=BlendConfig())
    with QuietLLM(str(tiny_qwen2_dir), dtype="float32", kv_store_dir=str(store)) as llm:
        with pytest.raises(FingerprintMismatchError, match="architecture"):
            llm.generate([PROMPT], GREEDY, blend=BlendConfig())


def test_prefix_cache_alongside_blending(tiny_llama_dir):
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    cfg = BlendConfig(recompute_ratio=0.2)
    first = llm.generate([PROMPT], GREEDY, blend=cfg)[0]
    second = llm.generate([PROMPT], GREEDY, blend=cfg)[0]
    assert second.metrics.num_cached_tokens > first.metrics.num_cached_tokens == 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.blend_stats.prefix_cached_tokens == second.metrics.num_cached_tokens
    # The same token ids as a plain prompt never alias the blended (approximate) blocks.
    ids = llm.blend_manager().prepare(PROMPT, cfg).prompt.token_ids
    plain = llm.generate([ids], GREEDY)[0]
    assert plain.metrics.num_cached_tokens == 0
    # Another ratio is another cache salt.
    other = llm.generate([PROMPT], GREEDY, blend=BlendConfig(recompute_ratio=0.9))[0]
    assert other.metrics.num_cached_tokens == 0
    llm.engine.check_integrity()
    llm.close()


def test_bad_blended_prompts(tiny_llama_dir):
    with QuietLLM(str(tiny_llama_dir), dtype="float32", max_model_len=256) as llm:
        for bad, match in [
            ({"documents": ["ok", ""], "query": "q"}, "document 1 is empty"),
            ({"documents": "not a list", "query": "q"}, "must be a list"),
            ({"documents": ["a"], "chunks": [[1]], "query": "q"}, "exactly one"),
            ({"documents": ["a"], "query": "q", "bogus": 1}, "unknown keys"),
            ({"chunk_ids": [12345], "query": "q"}, "does not exist"),
            ({"documents": ["word " * 300], "query": "q"}, "max_model_len"),
        ]:
            with pytest.raises(InvalidRequestError, match=match):
                llm.generate([bad], GREEDY, blend=BlendConfig())
        with pytest.raises(ConfigError):
            BlendConfig(recompute_ratio=1.5)
        with pytest.raises(ConfigError):
            llm.generate(
                [PROMPT], GREEDY, blend=BlendConfig(check_layer=99, selection="v_deviation")
            )
        with pytest.raises(InvalidRequestError, match="blended prompt"):
            llm.generate(["plain text"], GREEDY, blend=BlendConfig())
        assert not llm.engine.has_unfinished_requests()
        assert llm.generate([PROMPT], GREEDY, blend=BlendConfig())[0].finished


def test_prompt_logits_of_reused_rows_are_refused(blend_llm):
    """Reused chunk rows stop being computed after the check layer: no logits exist for them."""
    state = blend_llm.blend_manager().prepare(PROMPT, BlendConfig())
    start = state.prompt.query_start
    with pytest.raises(InvalidRequestError, match=f"from position {start}"):
        blend_llm.generate([PROMPT], GREEDY, blend=BlendConfig(), logits_from=start - 1)
    out = blend_llm.generate([PROMPT], GREEDY, blend=BlendConfig(), logits_from=start)[0]
    assert out.extra["prompt_logits"].shape[0] == len(state.prompt.token_ids) - start


def test_precomputing_a_chunk_longer_than_the_model_is_a_clear_error(tiny_llama_dir):
    from blendkv.errors import PromptTooLongError

    llm = QuietLLM(str(tiny_llama_dir), dtype="float32")
    with pytest.raises(PromptTooLongError, match="split it into smaller chunks"):
        llm.precompute_chunks([[5] * 1100])
    llm.close()


def test_documents_are_tokenized_once(tiny_llama_dir):
    """A document seen again is not re-tokenized (RAG prompts repeat documents); the ids are
    the tokenizer's, and a caller mutating a returned list changes nothing."""
    from blendkv.connector.prompt import PromptBuilder
    from blendkv.models.model_files import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(tiny_llama_dir))
    builder = PromptBuilder(tokenizer)
    calls = []
    encode = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(a[0]) or encode(*a, **k)
    first = builder.encode(DOCS[0])
    first.append(-1)
    assert builder.encode(DOCS[0]) == encode(DOCS[0], add_special_tokens=False)
    builder.encode(DOCS[1])
    assert calls == [DOCS[0], DOCS[1]]
