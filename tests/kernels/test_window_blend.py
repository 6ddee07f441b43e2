"""Blending on a sliding-window model (a tiny random Mistral, window 8, blocks of 4): exact at
ratio 1.0, and at full reuse the loader skips the stored K/V no window reads without changing
a single logit."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import TINY, QuietLLM, make_tokenizer

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig

WINDOW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
DOCS = [
    "Paris is the capital of France. The Seine flows through Paris.",
    "Berlin is the capital of Germany. It has many museums and parks.",
]
PROMPT = {"documents": DOCS, "query": "Which city is the capital of France?"}


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    config = transformers.MistralConfig(**{**TINY, "num_hidden_layers": 2}, sliding_window=WINDOW)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def windowed_llm(mistral_dir, tmp_path_factory):
    llm = QuietLLM(
        str(mistral_dir),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        kv_store_dir=str(tmp_path_factory.mktemp("store")),
    )
    assert all(
        layer.self_attn.sliding_window == WINDOW for layer in llm.engine.runner.model.model.layers
    )
    yield llm
    del llm


def test_ratio_one_equals_full_prefill(windowed_llm):
    config = BlendConfig(recompute_ratio=1.0)
    state = windowed_llm.blend_manager().prepare(PROMPT, config)
    start = state.prompt.query_start
    assert start > 3 * WINDOW  # the prompt crosses the window several times
    blended = windowed_llm.generate([PROMPT], GREEDY, blend=config, logits_from=start)[0]
    full = windowed_llm.generate([state.prompt.token_ids], GREEDY, logits_from=start)[0]
    a, b = blended.extra["prompt_logits"], full.extra["prompt_logits"]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert blended.outputs[0].token_ids == full.outputs[0].token_ids
    assert blended.blend_stats.window_skipped_tokens == 0  # rows may read any stored token


def test_full_reuse_skips_what_no_window_reads(windowed_llm):
    config = BlendConfig(recompute_ratio=0.0)
    manager = windowed_llm.blend_manager()
    state = manager.prepare(PROMPT, config)
    start = state.prompt.query_start
    loader = windowed_llm.engine.kv_connector._loader
    assert loader.layer_windows == [WINDOW, WINDOW]
    skipping = windowed_llm.generate([PROMPT], GREEDY, blend=config, logits_from=start)[0]
    stats = skipping.blend_stats
    # brute force: a chunk token is read if a computed row (a token outside every chunk) or a
    # decode step sits within WINDOW - 1 positions after it
    n = len(state.prompt.token_ids)
    chunk = {j for s, e in state.prompt.chunk_spans for j in range(s, e)}
    readers = [p for p in range(n) if p not in chunk] + [n]
    read = {j for p in readers for j in range(p - WINDOW + 1, p + 1)}
    assert stats.window_skipped_tokens == 2 * len(chunk - read) > WINDOW  # token-layers
    assert stats.tokens_reused == state.prompt.num_chunk_tokens
    loader.layer_windows = []  # the same run loading every token
    try:
        loading = windowed_llm.generate([PROMPT], GREEDY, blend=config, logits_from=start)[0]
    finally:
        loader.layer_windows = [WINDOW, WINDOW]
    assert loading.blend_stats.window_skipped_tokens == 0
    assert loading.blend_stats.kv_bytes_loaded > stats.kv_bytes_loaded
    torch.testing.assert_close(
        skipping.extra["prompt_logits"], loading.extra["prompt_logits"], atol=0, rtol=0
    )
    assert skipping.outputs[0].token_ids == loading.outputs[0].token_ids


def test_triton_decode_graphs_match_the_torch_backend(mistral_dir, tmp_path):
    """Prompts crossing the window, decoded through DecodeGraphs (eager stand-in for capture)
    on the Triton backend: the same greedy tokens as the torch backend."""
    pytest.importorskip("triton", reason="triton is not installed")
    from blendkv.engine.cuda_graphs import DecodeGraphs, EagerCapture

    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[5 + i, 9, 13 + 2 * i, 17, 30 + i] * (2 + i) for i in range(2)]  # 10, 15 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = QuietLLM(
            str(mistral_dir),
            dtype="float32",
            block_size=4,
            device=device,
            attention_backend=backend,
            kv_store_dir=str(tmp_path / backend),
        )
        if backend == "triton":
            engine = llm.engine
            engine.runner.decode_graphs = DecodeGraphs(
                engine.model,
                engine.attn_backend,
                engine.runner.kv_caches,
                4,
                max_num_seqs=2,
                max_model_len=64,
                capture=EagerCapture(),
            )
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if backend == "triton":
            graphs = engine.runner.decode_graphs
            assert graphs.sizes == [1, 2]
            # the windowed layers' layout is retained with each graph
            assert all(graphs.retained[size] for size in graphs.sizes)
        llm.close()
    assert outs["triton"] == outs["torch"]
