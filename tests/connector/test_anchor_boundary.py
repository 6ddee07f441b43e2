"""Chunks precomputed behind the previous chunk's boundary (``anchor_boundary_tokens``): the
keys, the contexts, and reuse against a transformers reference built from the same contexts."""

from __future__ import annotations

import pytest
import torch
from helpers import BLEND_DOCS as DOCS
from helpers import BLEND_QUERY as QUERY
from helpers import QuietLLM, reference_full_reuse_logits

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.errors import ConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = {"documents": DOCS, "query": QUERY}
REUSE = BlendConfig(recompute_ratio=0.0)
N = 3


@pytest.fixture(scope="module")
def boundary_llm(arch_dir):
    _, path = arch_dir
    llm = QuietLLM(
        str(path),
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        anchor_boundary_tokens=N,
    )
    yield llm
    llm.close()


def test_contexts_and_keys(boundary_llm, blend_llm):
    m, plain = boundary_llm.blend_manager(), blend_llm.blend_manager()
    state = m.prepare(PROMPT, REUSE)
    chunks = state.prompt.chunks
    assert len(chunks) >= 3
    assert state.chunk_contexts[0] == m.anchor_ids
    for i in range(1, len(chunks)):
        assert state.chunk_contexts[i] == m.anchor_ids + chunks[i - 1][-N:]
    # the first chunk follows the anchor alone: the same key as without boundaries
    assert state.chunk_keys[0] == plain.prepare(PROMPT, REUSE).chunk_keys[0]
    # a chunk after another neighbour is another entry
    swapped = m.prepare({**PROMPT, "documents": [DOCS[1], DOCS[0], *DOCS[2:]]}, REUSE)
    assert swapped.chunk_keys[2] != state.chunk_keys[2]
    assert swapped.chunk_keys[0] != state.chunk_keys[1]  # DOCS[1] now follows the anchor


def test_reuse_equals_reference_behind_each_boundary(boundary_llm, hf_model):
    """Ratio 0: the query's logits equal transformers over each chunk's K/V computed behind
    the anchor plus its neighbour's last N tokens, both when the chunks are computed at query
    time (missed) and when they are read back from the store."""
    m = boundary_llm.blend_manager()
    state = m.prepare(PROMPT, REUSE)
    ref = reference_full_reuse_logits(hf_model, m, state, contexts=state.chunk_contexts)
    plain = reference_full_reuse_logits(hf_model, m, state)
    assert (ref - plain).abs().max() > 1e-3  # the boundary changes the chunks' K/V
    start = state.prompt.query_start
    missed = boundary_llm.generate([PROMPT], GREEDY, blend=REUSE, logits_from=start)[0]
    m.flush()
    hit = boundary_llm.generate([PROMPT], GREEDY, blend=REUSE, logits_from=start)[0]
    assert missed.blend_stats.chunks_missed == len(state.prompt.chunks)
    assert hit.blend_stats.chunks_hit == len(state.prompt.chunks)
    for out in (missed, hit):
        torch.testing.assert_close(out.extra["prompt_logits"], ref, atol=1e-4, rtol=0)


def test_precompute_with_contexts_is_what_a_request_reads(boundary_llm):
    m = boundary_llm.blend_manager()
    docs = [d + " (again)" for d in DOCS]
    state = m.prepare({**PROMPT, "documents": docs}, REUSE)
    results = boundary_llm.precompute_chunks(state.prompt.chunks, contexts=state.chunk_contexts)
    assert all(r is not None for r in results)
    assert all(key in m.store for key in state.chunk_keys)
    out = boundary_llm.generate([{**PROMPT, "documents": docs}], GREEDY, blend=REUSE)[0]
    assert out.blend_stats.chunks_missed == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_boundary_is_refused(bad, arch_dir):
    with pytest.raises(ConfigError, match="anchor_boundary_tokens"):
        QuietLLM(str(arch_dir[1]), anchor_boundary_tokens=bad)
