"""Engines on stores with a K/V codec (tiny random Llama, float32): ratio 1.0 from an int8
store is full prefill; ``store convert`` gives the store ingesting with that codec gives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import QuietLLM
from store_helpers import same_bits
from test_index import HashEmbedder

from blendkv import LLM, SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.commands.store import _bytes_per_token
from blendkv.errors import BlendKVError
from blendkv.rag.store_convert import convert_store
from blendkv.store import KVStore
from blendkv.store.backends import stored_fingerprint

DOCS = [
    "The Amber Lighthouse stands on Gull Point and was built in 1871 by Ada Whitcombe.",
    "Brindle Valley grows pears and apples; its harvest fair is held every October.",
]
QUERY = "Who built the Amber Lighthouse?"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _llm(model_dir, **options) -> LLM:
    return QuietLLM(str(model_dir), dtype="float32", enable_prefix_caching=False, **options)


def test_ratio_one_from_an_int8_store_equals_full_prefill(tiny_llama_dir, tmp_path):
    prompt = {"documents": DOCS, "query": QUERY}
    llm = _llm(tiny_llama_dir, kv_store_dir=str(tmp_path / "kv"), kv_codec="int8")
    try:
        manager = llm.blend_manager()
        assert manager.store.kv_codec == "int8"
        llm.generate([prompt], GREEDY, blend=BlendConfig(recompute_ratio=0.0))  # fills it
        manager.flush()
        state = manager.prepare(prompt, BlendConfig(recompute_ratio=1.0))
        start = state.prompt.query_start
        cfg = BlendConfig(recompute_ratio=1.0)
        blended = llm.generate([prompt], GREEDY, blend=cfg, logits_from=start)[0]
        full = llm.generate([state.prompt.token_ids], GREEDY, logits_from=start)[0]
        assert blended.blend_stats.chunks_hit == len(DOCS)
        a, b = blended.extra["prompt_logits"], full.extra["prompt_logits"]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert blended.outputs[0].token_ids == full.outputs[0].token_ids
        # full reuse does read the int8 K/V: not full prefill (the check above can fail)
        reuse = llm.generate(
            [prompt], GREEDY, blend=BlendConfig(recompute_ratio=0.0), logits_from=start
        )[0]
        assert not torch.allclose(reuse.extra["prompt_logits"], b, atol=1e-5, rtol=0)
    finally:
        llm.close()
    # An explicit other codec is refused naming both; unset follows the store.
    with pytest.raises(BlendKVError, match="codec 'int8'.*'int4'"):
        _llm(tiny_llama_dir, kv_store_dir=str(tmp_path / "kv"), kv_codec="int4").blend_manager()
    assert stored_fingerprint(tmp_path / "kv").kv_codec == "int8"


def _ingest(model_dir, store, **options) -> list[str]:
    from blendkv.rag import RAGPipeline

    llm = _llm(model_dir, **options)
    with RAGPipeline(store, llm=llm, chunk_tokens=16, embedder=HashEmbedder()) as rag:
        doc_ids = rag.add_documents(DOCS, progress=False)
    llm.close()
    return doc_ids


def _answer(model_dir, store) -> str:
    from blendkv.rag import RAGPipeline

    llm = _llm(model_dir, kv_codec=stored_fingerprint(store).kv_codec)
    with RAGPipeline(store, llm=llm, chunk_tokens=16, embedder=HashEmbedder(), create=False) as rag:
        answer = rag.query(QUERY, k=2, sampling_params=GREEDY)
        assert answer.blend_stats.chunks_hit == answer.blend_stats.num_chunks == 2
    llm.close()
    return answer.answer


def test_convert_equals_ingesting_with_the_codec(tiny_llama_dir, tmp_path):
    src, direct, converted = tmp_path / "src", tmp_path / "direct", tmp_path / "converted"
    _ingest(tiny_llama_dir, src)
    _ingest(tiny_llama_dir, direct, kv_codec="int8")
    result = convert_store(src, converted, "int8")
    assert result.report.ok, result.report
    assert (result.src_codec, result.dst_codec) == ("none", "int8")
    assert result.src_bytes >= 1.9 * result.dst_bytes
    fp = stored_fingerprint(direct)
    with (
        KVStore(direct, fp, readonly=True) as a,
        KVStore(converted, stored_fingerprint(converted), readonly=True) as b,
    ):
        metas = sorted(a.iter_meta(), key=lambda m: m.key)
        assert [m.key for m in metas] == sorted(m.key for m in b.iter_meta())
        for m in metas:  # the same encoded bytes, key for key
            assert same_bits(a.get(m.key).kv, b.get(m.key).kv)
    assert _answer(tiny_llama_dir, converted) == _answer(tiny_llama_dir, direct)
    # the CLI: converting back, with verify at the end
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "blendkv.cli",
            "store",
            "convert",
            str(converted),
            str(tmp_path / "back"),
            "--codec",
            "none",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(int8," in done.stdout and "(none," in done.stdout
    with KVStore(converted, stored_fingerprint(converted), readonly=True) as b:
        tokens = sum(m.num_tokens for m in b.iter_meta())
        assert _bytes_per_token(b, b.stats().bytes) == b.stats().bytes / tokens


def test_convert_through_redis(redis_server, tmp_path):
    """LMDB -> Redis (int8) -> LMDB (none): values decode the same, embeddings travel."""
    from store_helpers import make_fingerprint, make_kv

    from blendkv.rag.catalog import open_catalog
    from blendkv.rag.chunk_store import ChunkStore
    from blendkv.store import NewChunk, open_kv_store

    redis_server.flush()
    fp = make_fingerprint()
    chunks = [
        NewChunk(bytes([i]) * 16, make_kv(i, 12), f"text {i}", tuple(range(12)), "doc", i)
        for i in range(3)
    ]
    with ChunkStore(tmp_path / "src", fp, HashEmbedder()) as src:
        src.add_chunks(chunks)
        catalog = open_catalog(tmp_path / "src", src.kv)
        catalog.put("doc", source="doc.txt", metadata={}, chunk_keys=[c.key for c in chunks])
    shared = convert_store(tmp_path / "src", redis_server.url, "int8")
    assert shared.report.ok and shared.dst_codec == "int8", shared.report
    back = convert_store(redis_server.url, tmp_path / "back", "none")
    assert back.report.ok and back.chunks == 3, back.report
    with (
        open_kv_store(redis_server.url, fp.with_codec("int8")) as red,
        KVStore(tmp_path / "back", fp, readonly=True) as lmdb,
    ):
        assert len(red.embeddings([c.key for c in chunks])) == 3
        for c in chunks:
            assert same_bits(lmdb.get(c.key).kv, red.get(c.key).kv)
            assert not same_bits(lmdb.get(c.key).kv, c.kv)  # int8 went in between
    with pytest.raises(BlendKVError, match="already holds a store"):
        convert_store(tmp_path / "src", tmp_path / "back", "int4")
    assert open_catalog(redis_server.url, red).documents()["doc"]["source"] == "doc.txt"
