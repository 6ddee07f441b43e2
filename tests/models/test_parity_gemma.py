"""Gemma 2 and Gemma 3 (text) parity gates (tests/models/parity.py): sliding-window layers
(:data:`WINDOW` tokens) among global ones, scaled embeddings, ``(1 + w)`` and sandwich norms,
``query_pre_attn_scalar``; Gemma 2's attention and final soft-caps (small caps, so they bite);
Gemma 3's q/k norms and its own RoPE base on sliding layers (global layers: linear scaling)."""

from __future__ import annotations

import pytest
import torch
import transformers
from parity import ATOL, BLEND_PROMPT, GREEDY, TINY, WINDOW, Family, ParityGate

from blendkv.blend.config import BlendConfig
from blendkv.blend.window_skip import computed_rows, layer_skips
from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.models.model_files import load_model, resolve_model

FAMILIES = {
    "gemma2": Family(
        "gemma2",
        lambda: transformers.Gemma2Config(
            **TINY,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
        ),
        transformers.Gemma2ForCausalLM,
    ),
    "gemma3": Family(
        "gemma3",
        lambda: transformers.Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 3},
            sliding_window=WINDOW,
            sliding_window_pattern=2,  # sliding, full, sliding
            query_pre_attn_scalar=24,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
        transformers.Gemma3ForCausalLM,
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gate(request, tmp_path_factory) -> ParityGate:
    return ParityGate(FAMILIES[request.param], tmp_path_factory.mktemp(request.param))


def test_dense(gate):
    gate.check_dense()


def test_engine(gate):
    gate.check_engine()


def test_triton(gate):
    gate.check_triton()


def test_layers(gate):
    """Windows where ``layer_types`` says; Gemma 3's sliding layers rotate with the local base."""
    ours = load_model(resolve_model(gate.path), torch.float32, TorchAttentionBackend())
    types = gate.hf.config.layer_types
    layers = ours.model.layers
    assert "sliding_attention" in types and "full_attention" in types
    expected = [WINDOW if t == "sliding_attention" else None for t in types]
    assert [layer.self_attn.sliding_window for layer in layers] == expected
    if gate.family.name == "gemma3":
        local, full = ours.model.rotary_emb_local, ours.model.rotary_emb
        for t, layer in zip(types, layers, strict=True):
            assert layer.self_attn.rotary_emb is (local if t == "sliding_attention" else full)
        assert not torch.equal(local.tables("cpu")[0], full.tables("cpu")[0])


@pytest.mark.parametrize("delta", [-1, 1])
def test_window_off_by_one_fails(gate, delta):
    """The gate can fail: a window one token off gives other logits."""
    ours = load_model(resolve_model(gate.path), torch.float32, TorchAttentionBackend())
    for layer in ours.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window += delta
    ids = torch.randint(2, 320, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(len(ids)), None, None))
    expected = gate.hf_logits(ids.tolist())
    assert (logits - expected).abs().max() > 100 * ATOL


def test_reused_k_rotated_with_each_layers_rope(gate):
    """Blended at ratio 0.0: every reused chunk row's K in the pool is its stored pre-RoPE K
    rotated at its fused position with *its layer's* RoPE (Gemma 3: local base on sliding
    layers, the linearly scaled global base on full ones)."""
    llm = gate.llm(enable_prefix_caching=False)
    try:
        engine, config = llm.engine, BlendConfig(recompute_ratio=0.0)
        state = llm.blend_manager().prepare(BLEND_PROMPT, config)
        p = state.prompt
        rid = engine.add_request(BLEND_PROMPT, GREEDY, blend=config)
        seq = engine.requests[rid].seq
        for _ in range(10):  # chunk precompute (possibly its own steps), the fused prefill
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                break
            engine.step()
        assert seq.num_computed_tokens >= seq.num_prompt_tokens
        bs = engine.config.cache.block_size
        table = torch.tensor(seq.block_table)
        stored = llm.engine.runner.compute_chunk_kv(state.chunk_contexts, p.chunks)
        layers = engine.model.model.layers
        # a sliding layer does not load the chunk tokens its window never reads (window_skip)
        n, windows = len(p.token_ids), engine.kv_connector._loader.layer_windows
        rows = computed_rows(p.chunk_spans, 0, n)
        skips = layer_skips(p.chunk_spans, rows, n, windows)
        for (s, e), kv, skip in zip(p.chunk_spans, stored, skips, strict=True):
            for i, (cache, layer) in enumerate(zip(engine.runner.kv_caches, layers, strict=True)):
                positions = torch.arange(s + skip[i], e)
                slots = table[positions // bs] * bs + positions % bs
                pooled = cache[0].view(-1, *cache.shape[-2:])[slots]
                expected = layer.self_attn.rotary_emb.rotate_k(positions, kv[i, 0, skip[i] :])
                torch.testing.assert_close(pooled, expected, atol=1e-5, rtol=0)
        engine.abort_request(rid)
    finally:
        llm.close()
