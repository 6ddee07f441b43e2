"""The blend start gate: blend@1.0 must be full prefill at engine start, or the engine refuses to
blend and serves full prefill (``blendkv.guards.start_gate``)."""

from __future__ import annotations

import logging

import pytest
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend import row_plan
from blendkv.config import GuardConfig
from blendkv.errors import ConfigError
from blendkv.guards.start_gate import gate_enabled, run_start_gate

DOCS = ["Alpha beta gamma delta. " * 6, "The quick brown fox jumps over the lazy dog. " * 4]
QUERY = "Question: what jumps? Answer:"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", block_size=4, blend_start_gate=True)
    yield llm
    llm.close()


def _corrupt_k(monkeypatch):
    """A broken K correction: it moves the fresh K of the rows the layer recomputes."""
    real = row_plan.correct_kept_rows

    def broken(backend, rotary, kv_cache, which, shrink, pooled, recomputed, k, v, kept, n):
        k.add_(0.5)
        return real(backend, rotary, kv_cache, which, shrink, pooled, recomputed, k, v, kept, n)

    monkeypatch.setattr(row_plan, "correct_kept_rows", broken)


def test_a_sound_model_passes_and_blends(llm):
    gate = llm.start_gate
    assert gate is not None and gate.passed, gate
    assert gate.kl < 1e-6 and gate.full_tokens == gate.blend_tokens
    out = llm.generate({"documents": DOCS, "query": QUERY}, SamplingParams(max_tokens=3))[0]
    assert out.blend_stats.tokens_reused > 0
    assert not hasattr(out.blend_stats, "fallback")
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_broken_correction_is_refused_and_requests_run_full_prefill(llm, monkeypatch, caplog):
    prompt = {"documents": DOCS, "query": QUERY}
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ids = llm.generate(prompt, params)[0].prompt_token_ids
    full = llm.generate([ids], params)[0]  # plain prefill never runs the correction
    _corrupt_k(monkeypatch)
    with caplog.at_level("WARNING", logger="blendkv.guards.start_gate"):
        gate = run_start_gate(llm.engine)
    assert not gate.passed and "differs from full prefill" in gate.reason
    assert gate.kl > 1e-3
    assert gate.reason in caplog.text
    conn = llm.engine.kv_connector
    assert conn.blend_refused == gate.reason
    try:
        # Every blended request now runs full prefill of its tokens (the corruption, still in
        # place, would show in any fused prefill), and says why.
        out = llm.generate(prompt, params)[0]
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == full.outputs[0].token_ids
        assert out.blend_stats.fallback == gate.reason
        assert out.blend_stats.tokens_reused == 0 and out.blend_stats.chunks_hit == 0
        assert out.blend_stats.to_dict()["fallback"] == gate.reason
    finally:
        conn.blend_refused = None


def test_switch():
    assert gate_enabled(None, True) and not gate_enabled(None, False)
    assert gate_enabled(True, False) and not gate_enabled(False, True)
    with pytest.raises(ConfigError, match="blend_start_gate must be None, True or False"):
        GuardConfig(blend_start_gate="yes")


def test_a_blend_path_that_raises_is_refused_not_fatal(llm, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("unsupported layer")

    monkeypatch.setattr(row_plan, "correct_kept_rows", crash)
    gate = run_start_gate(llm.engine)
    conn = llm.engine.kv_connector
    try:
        assert not gate.passed and "RuntimeError: unsupported layer" in gate.reason
        assert not llm.engine.has_unfinished_requests()
        out = llm.generate({"documents": DOCS, "query": QUERY}, SamplingParams(max_tokens=2))[0]
        assert out.blend_stats.fallback == gate.reason
    finally:
        conn.blend_refused = None


def test_a_max_model_len_shorter_than_the_gate_prompt_skips_the_gate(tiny_llama_dir, caplog):
    """The gate's canned prompt does not fit: the engine starts, ungated, and says so."""
    caplog.set_level(logging.INFO, logger="blendkv.guards.start_gate")
    short = QuietLLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, blend_start_gate=True)
    try:
        assert short.start_gate is None
        assert short.engine.kv_connector.blend_refused is None
        assert "start gate skipped" in caplog.text
    finally:
        short.close()
