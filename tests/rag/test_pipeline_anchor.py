"""What a pipeline's chunks are precomputed behind: a new store, the prefix of the pipeline's
own prompts (chat template and instruction), so the first passage's stored K/V is full
prefill's; an existing store, its own anchor; an engine given an anchor, that one. Chunks an
engine computes at query time (request documents, chunks not in the store) stay behind the
engine's own anchor, whatever the store's.

The oracle for "precomputed behind the prompt's prefix": reusing the one retrieved chunk with
nothing recomputed gives full prefill's logits.
"""

from __future__ import annotations

import pytest
import torch
from helpers import QuietLLM

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.rag import RAGPipeline
from blendkv.rag.pipeline import DEFAULT_INSTRUCTION
from blendkv.store import FingerprintMismatchError
from blendkv.store.backends import stored_fingerprint

DOC = "Paris is the capital of France. The Seine flows through Paris and its bridges."
QUESTION = "What is the capital of France?"
ONE = SamplingParams(max_tokens=1, temperature=0)


def make_llm(model_dir, **options):
    return QuietLLM(str(model_dir), dtype="float32", enable_prefix_caching=False, **options)


def reuse_and_full_logits(rag):
    """Prompt logits of the last 3 prompt rows: the retrieved chunk reused as stored (nothing
    recomputed), and full prefill of the same tokens."""
    (source,) = rag.retrieve(QUESTION, k=1)
    prompt = rag.blended_prompt(QUESTION, [source])
    llm = rag.llm
    ids = llm.blend_manager().prepare(prompt, BlendConfig(recompute_ratio=1.0)).prompt.token_ids
    start = len(ids) - 3
    reuse = BlendConfig(recompute_ratio=0.0)
    (blended,) = llm.generate([prompt], ONE, blend=reuse, logits_from=start)
    (full,) = llm.generate([ids], ONE, logits_from=start)
    assert blended.blend_stats.chunks_hit == 1  # the stored chunk, not one computed now
    return blended.extra["prompt_logits"], full.extra["prompt_logits"]


def test_a_new_store_is_anchored_on_the_pipelines_prompt_prefix(tiny_llama_dir, tmp_path):
    store = tmp_path / "store"
    with make_llm(tiny_llama_dir) as llm, RAGPipeline(store, llm=llm, chunk_tokens=64) as rag:
        rag.ingest([DOC], progress=False)
        builder = rag.manager.builder
        anchor = builder.anchor(None, DEFAULT_INSTRUCTION)
        assert anchor != builder.anchor(None, None)
        reused, full = reuse_and_full_logits(rag)
        torch.testing.assert_close(reused, full, atol=1e-5, rtol=1e-5)
    assert stored_fingerprint(store).anchor_token_ids == tuple(anchor)
    # An engine opening the store with no anchor of its own follows it.
    with make_llm(tiny_llama_dir, kv_store_dir=str(store)) as llm:
        manager = llm.blend_manager()
        assert manager.store_anchor_ids == anchor
        assert manager.anchor_ids == builder.anchor(None, None)  # query-time chunks: its own


def test_a_store_built_behind_another_anchor_is_followed(tiny_llama_dir, tmp_path):
    """A store whose chunks sit behind the template alone (a pipeline without instruction, or
    one built before pipelines anchored on theirs) keeps serving them to a pipeline with one:
    its chunks are hits, not recomputed, and not full prefill's K/V."""
    store = tmp_path / "store"
    with (
        make_llm(tiny_llama_dir) as llm,
        RAGPipeline(store, llm=llm, chunk_tokens=64, instruction=None) as rag,
    ):
        rag.ingest([DOC], progress=False)
        template = rag.manager.builder.anchor(None, None)
    assert stored_fingerprint(store).anchor_token_ids == tuple(template)
    with make_llm(tiny_llama_dir) as llm, RAGPipeline(store, llm=llm, create=False) as rag:
        assert rag.manager.store_anchor_ids == template
        reused, full = reuse_and_full_logits(rag)
        assert (reused - full).abs().max() > 1e-3


def test_an_engine_anchor_is_kept_and_a_conflicting_store_refused(tiny_llama_dir, tmp_path):
    own = "Use only these notes.\n\n"
    with (
        make_llm(tiny_llama_dir, anchor_instruction=own) as llm,
        RAGPipeline(tmp_path / "store", llm=llm, chunk_tokens=64) as rag,
    ):
        rag.ingest([DOC], progress=False)
        expected = rag.manager.builder.anchor(None, own)
    assert stored_fingerprint(tmp_path / "store").anchor_token_ids == tuple(expected)
    with (
        make_llm(tiny_llama_dir) as llm,
        RAGPipeline(tmp_path / "default", llm=llm, chunk_tokens=64) as rag,
    ):
        rag.ingest([DOC], progress=False)
    with make_llm(tiny_llama_dir, anchor_instruction=own) as llm:
        with pytest.raises(FingerprintMismatchError, match="behind another anchor"):
            RAGPipeline(tmp_path / "default", llm=llm, create=False)


def test_query_time_chunks_stay_behind_the_engines_anchor(tiny_llama_dir, tmp_path):
    """An engine on a pipeline store (anchored on the pipeline's instruction) serves the stored
    chunks from it, and computes a new document behind its own anchor: the same answer as an
    engine without the store (a server's request documents, ``blendkv serve --store``)."""
    store = tmp_path / "store"
    with make_llm(tiny_llama_dir) as llm, RAGPipeline(store, llm=llm, chunk_tokens=64) as rag:
        rag.ingest([DOC], progress=False)
    other = "The Loire is the longest river in France and flows to the Atlantic."
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    new_doc = {"documents": [other], "query": QUESTION}
    stored_doc = {"documents": [DOC], "query": QUESTION}
    with make_llm(tiny_llama_dir) as alone:
        (want,) = alone.generate([new_doc], greedy, blend=BlendConfig())
    with make_llm(tiny_llama_dir, kv_store_dir=str(store)) as llm:
        manager = llm.blend_manager()
        assert manager.store_anchor_ids != manager.anchor_ids
        (got,) = llm.generate([new_doc], greedy, blend=BlendConfig())
        assert got.blend_stats.chunks_missed == 1
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        state = manager.prepare(stored_doc, BlendConfig())
        assert state.chunk_contexts == [manager.store_anchor_ids]  # ingested: served from there
        (hit,) = llm.generate([stored_doc], greedy, blend=BlendConfig())
        assert hit.blend_stats.chunks_hit == 1 and hit.blend_stats.chunks_missed == 0
