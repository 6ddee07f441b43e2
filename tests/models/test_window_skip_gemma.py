"""The loader's per-layer window skip on Gemma 2 / Gemma 3 (windowed layers among global ones,
Gemma 3's own RoPE table on its sliding layers): at full reuse each windowed layer leaves out
the stored tokens its window never reads, global layers load all, and not a logit changes; the
default blend (rows recomputed) skips nothing; ratio 1.0 is still the full prefill."""

from __future__ import annotations

import pytest
import torch
from helpers import QuietLLM, make_tokenizer
from parity import ATOL, GREEDY, WINDOW, randomize
from test_parity_gemma import FAMILIES

from blendkv import LLM
from blendkv.blend.config import BlendConfig

# Three documents: the first lies more than a window before the query (whose rows read back
# WINDOW - 1 positions), so its leading tokens are read by no windowed layer.
PROMPT = {
    "documents": [
        "Paris is the capital of France. The Seine flows through Paris.",
        "Berlin is in Germany.",
        "Rome is in Italy.",
    ],
    "query": "Where is Paris?",
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gemma(request, tmp_path_factory):
    family = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    config = family.make_config()
    torch.manual_seed(0)
    hf = family.hf_class(config).eval()
    randomize(hf)
    hf.save_pretrained(path, safe_serialization=True)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    llm = QuietLLM(
        str(path),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        kv_store_dir=str(tmp_path_factory.mktemp("store")),
    )
    yield llm, hf
    llm.close()


def _run(llm: LLM, config: BlendConfig, skip: bool):
    """The blended PROMPT's query-row logits and output, with the window skip on or off."""
    start = llm.blend_manager().prepare(PROMPT, config).prompt.query_start  # makes the loader
    loader = llm.engine.kv_connector._loader
    windows = loader.layer_windows
    if not skip:
        loader.layer_windows = []
    try:
        return llm.generate([PROMPT], GREEDY, blend=config, logits_from=start)[0]
    finally:
        loader.layer_windows = windows


def test_full_reuse_skips_per_layer_and_no_logit_changes(gemma):
    llm, _ = gemma
    config = BlendConfig(recompute_ratio=0.0)
    _run(llm, config, skip=True)  # the chunks stored: both runs below read them
    skipping = _run(llm, config, skip=True)
    loader = llm.engine.kv_connector._loader
    windows = loader.layer_windows
    assert WINDOW in windows and None in windows  # windowed layers among global ones
    prompt = llm.blend_manager().prepare(PROMPT, config).prompt
    # brute force: at a windowed layer a chunk token is read if a computed row (a token outside
    # every chunk) or a decode step sits within WINDOW - 1 positions after it
    n = len(prompt.token_ids)
    chunk = {j for s, e in prompt.chunk_spans for j in range(s, e)}
    readers = [p for p in range(n) if p not in chunk] + [n]
    read = {j for p in readers for j in range(p - WINDOW + 1, p + 1)}
    unread = len(chunk - read)
    assert unread > 0
    expected = unread * sum(w is not None for w in windows)
    stats = skipping.blend_stats
    assert stats.window_skipped_tokens == expected
    loading = _run(llm, config, skip=False)
    assert loading.blend_stats.window_skipped_tokens == 0
    token_bytes = 2 * loader.kv_shape[1] * loader.kv_shape[2] * 4  # float32
    saved = loading.blend_stats.kv_bytes_loaded - stats.kv_bytes_loaded
    assert saved == expected * token_bytes
    torch.testing.assert_close(
        skipping.extra["prompt_logits"], loading.extra["prompt_logits"], atol=0, rtol=0
    )
    assert skipping.outputs[0].token_ids == loading.outputs[0].token_ids


def test_default_blend_skips_nothing_and_equals_it_bit_for_bit(gemma):
    llm, _ = gemma
    config = BlendConfig()
    assert not config.full_reuse
    skipping = _run(llm, config, skip=True)
    loading = _run(llm, config, skip=False)
    assert skipping.blend_stats.window_skipped_tokens == 0  # selection may keep any row
    assert skipping.blend_stats.tokens_reused > 0
    torch.testing.assert_close(
        skipping.extra["prompt_logits"], loading.extra["prompt_logits"], atol=0, rtol=0
    )
    assert skipping.outputs[0].token_ids == loading.outputs[0].token_ids


def test_ratio_one_equals_full_prefill(gemma):
    llm, hf = gemma
    config = BlendConfig(recompute_ratio=1.0)
    out = _run(llm, config, skip=True)
    prompt = llm.blend_manager().prepare(PROMPT, config).prompt
    with torch.no_grad():
        expected = hf(torch.tensor([prompt.token_ids])).logits[0, prompt.query_start :].float()
    torch.testing.assert_close(out.extra["prompt_logits"].cpu(), expected, atol=ATOL, rtol=0)
    assert out.blend_stats.tokens_reused == prompt.num_chunk_tokens > 0
    assert out.blend_stats.window_skipped_tokens == 0
