"""Many engine processes, one Redis store: what one process prefilled, another reuses.

Process A (a subprocess) ingests documents into ``redis://...``; process B (this one) opens
the same URL: it sees the same documents, rebuilds its FAISS index from the embeddings kept in
Redis (no re-embedding), and answers from A's chunk K/V (hits, no precompute).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import QuietLLM
from redis_server import RedisServer

from blendkv import SamplingParams
from blendkv.rag import RAGPipeline
from blendkv.rag.embedding import MiniLMEmbedder

DOCS = [
    "The Amber Lighthouse stands on Gull Point and was built in 1871 by Ada Whitcombe.",
    "Brindle Valley grows pears and apples; its harvest fair is held every October.",
]
MORE = ["The Copper Bridge over the Slate River opened to trains in 1903."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


class CountingEmbedder:
    def __init__(self) -> None:
        self.inner = MiniLMEmbedder()
        self.name, self.dim = self.inner.name, self.inner.dim
        self.texts = 0

    def embed(self, texts):
        self.texts += len(texts)
        return self.inner.embed(texts)


def ingest_in_another_process(model_dir, url, docs) -> list[str]:
    script = f"""
import json
from blendkv import LLM
from blendkv.rag import RAGPipeline
llm = LLM({str(model_dir)!r}, dtype="float32", enable_prefix_caching=False, warmup=False)
with RAGPipeline({url!r}, llm=llm, chunk_tokens=32) as rag:
    print(json.dumps(rag.add_documents({docs!r}, progress=False)))
llm.close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


@pytest.fixture
def url(redis_server):
    redis_server.flush()
    return redis_server.url


def test_second_process_reuses_the_first_ones_chunks(tiny_llama_dir, url):
    doc_ids = ingest_in_another_process(tiny_llama_dir, url, DOCS)
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    embedder = CountingEmbedder()
    with RAGPipeline(url, llm=llm, chunk_tokens=32, embedder=embedder, create=False) as rag:
        assert sorted(rag.documents()) == sorted(doc_ids)
        assert embedder.texts == 0  # the FAISS index came from Redis, nothing re-embedded
        answer = rag.query("Who built the Amber Lighthouse?", k=2, sampling_params=GREEDY)
        st = answer.blend_stats
        assert st.chunks_hit == st.num_chunks == 2 and st.chunks_missed == 0
        assert st.precompute_seconds == 0.0 and st.store_errors == 0
        assert rag.verify().ok, rag.verify()
        # A process that was already open sees documents another process adds later.
        [more] = ingest_in_another_process(tiny_llama_dir, url, MORE)
        hits = rag.retrieve("Which bridge opened to trains?", k=1)
        assert hits[0].doc_id == more
        num_chunks = len(rag.store.kv)
    llm.close()
    verify = subprocess.run(
        [sys.executable, "-m", "blendkv.cli", "store", "verify", "--store", url, "--json"],
        capture_output=True,
        check=True,
    )
    report = json.loads(verify.stdout.decode().strip().splitlines()[-1])
    assert report["ok"] and report["entries"] == num_chunks, report


def test_store_lost_mid_request_recomputes_then_reconnects(tiny_llama_dir, tmp_path):
    server = RedisServer(tmp_path).start()
    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        enable_prefix_caching=False,
        kv_store_dir=server.url,
        kv_store_memory_bytes=1,  # no memory tier: every read goes to Redis
    )
    prompt = {"documents": DOCS, "query": "Who built the lighthouse?"}
    try:
        first = llm.generate([prompt], GREEDY)[0]
        assert first.blend_stats.chunks_missed == 2
        llm.blend_manager().flush()
        warm = llm.generate([prompt], GREEDY)[0]
        assert warm.blend_stats.chunks_hit == 2
        engine = llm.engine
        rid = engine.add_request(prompt, GREEDY, blend=None)
        server.kill()  # the request is queued; its chunks must now come from somewhere else
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out
        lost = outs[rid]
        assert lost.outputs[0].token_ids == first.outputs[0].token_ids
        assert lost.blend_stats.chunks_missed == 2 and lost.blend_stats.store_errors > 0
        llm.blend_manager().flush()  # its write-back failed, logged, not raised
        assert llm.blend_manager().writer.num_failed > 0
        server.start()  # back, empty: the next request reconnects and writes back again
        again = llm.generate([prompt], GREEDY)[0]
        assert again.blend_stats.store_errors == 0 and again.blend_stats.chunks_missed == 2
        llm.blend_manager().flush()
        assert llm.generate([prompt], GREEDY)[0].blend_stats.chunks_hit == 2
    finally:
        llm.close()
        server.kill()
