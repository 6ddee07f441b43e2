"""Distributed ingest on a local Ray cluster (2 CPUs): two Ray Data workers, each with its own
engine on the tiny random Llama, ingest a corpus into one Redis store.

The store they leave equals the one a single-process ``RAGPipeline.ingest`` of the same files
leaves: the same chunk keys, K/V bits, chunk texts and owners, catalog entries and search
results. A worker killed mid-document (after storing chunks, before their embeddings and the
document's catalog entry) loses nothing: Ray restarts it and the run completes the store; a
re-run finds nothing to do. A model whose fingerprint differs from the store's is refused
before anything is written.
"""

from __future__ import annotations

import functools
import os
import random
import sys

import pytest
import torch
from helpers import QUIET, QuietLLM

from blendkv.rag import RAGPipeline
from blendkv.rag.catalog import open_catalog
from blendkv.rag.chunk_store import ChunkStore
from blendkv.rag.embedding import MiniLMEmbedder
from blendkv.rag.ingest import WRITE_BATCH
from blendkv.store import FingerprintMismatchError
from blendkv.store.backends import stored_fingerprint

if os.environ.get("CI"):
    import ray  # the dev extra installs it: CI runs these tests
else:
    ray = pytest.importorskip("ray", reason="pip install 'blendkv[ray]'")

from blendkv.rag.distributed import ingest_on_ray  # noqa: E402

pytestmark = pytest.mark.timeout(600)

CHUNK_TOKENS = 32
WORDS = (
    "lighthouse harbour copper bridge river valley orchard pear apple museum tram station "
    "archive ledger winter summer festival granite quarry mill canal lock keeper ferry"
).split()
QUERIES = ["Who keeps the lighthouse?", "When does the ferry cross the canal?", "granite quarry"]


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    sentences = []
    for _ in range(words // 8):
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(8)).capitalize() + ".")
    return " ".join(sentences)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Long documents (two write batches of chunks each: about 20 chunks of 32 tokens), a short
    one, one in a subfolder and a duplicate of another's text under a second name."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "sub").mkdir()
    files = {"a.md": text(1, 120), "b.txt": text(2, 128), "sub/c.md": text(3, 112)}
    files.update({"d.md": text(4, 40), "z-copy-of-a.md": files["a.md"]})
    for name, body in files.items():
        (root / name).write_text(body)
    return root


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # Workers unpickle this module's embedder by value (pytest's module name is not importable).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def db(redis_server, n: int) -> str:
    return redis_server.url.rsplit("/", 1)[0] + f"/{n}"


@pytest.fixture(scope="module")
def reference(redis_server, tiny_llama_dir, corpus):
    """What one process stores (Redis db 1)."""
    redis_server.flush()
    url = db(redis_server, 1)
    llm = QuietLLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    with RAGPipeline(url, llm=llm, chunk_tokens=CHUNK_TOKENS) as rag:
        report = rag.ingest(paths=[corpus], progress=False)
    llm.close()
    want = facts(url)
    # the long documents take two write batches (a worker can die between them)
    assert sum(len(keys) > WRITE_BATCH for _, keys in want["docs"].values()) == 3
    return url, report, want


def facts(url: str) -> dict:
    """Everything that must agree between two stores: chunks (key -> owner, position, text,
    token ids, K/V), catalog (without the time added), search results, and verify."""
    fp = stored_fingerprint(url)
    with ChunkStore(url, fp, MiniLMEmbedder()) as store:
        catalog = open_catalog(url, store.kv)
        chunks = {
            m.key: (m.doc_id, m.position, m.text, tuple(m.token_ids)) for m in store.kv.iter_meta()
        }
        values = {key: store.kv.get(key).kv for key in chunks}
        docs = {
            d: ({k: v for k, v in e.items() if k != "added"}, catalog.chunk_keys(d))
            for d, e in catalog.documents().items()
        }
        searches = [[(h.meta.key, round(h.score, 5)) for h in store.search(q, 6)] for q in QUERIES]
        embedded = all(e is not None for e in store.kv.embeddings(list(chunks)))
        return dict(
            fingerprint=fp,
            chunks=chunks,
            values=values,
            docs=docs,
            searches=searches,
            embedded=embedded,
            ok=store.verify().ok,
        )


def assert_same(got: dict, want: dict) -> None:
    assert got["fingerprint"] == want["fingerprint"]
    assert got["chunks"] == want["chunks"]
    assert got["values"].keys() == want["values"].keys()
    assert all(torch.equal(got["values"][k], want["values"][k]) for k in want["values"])
    assert got["docs"] == want["docs"]
    assert got["searches"] == want["searches"]
    assert got["embedded"] and got["ok"]


def on_ray(url, model_dir, **kw):
    options = {**QUIET, "dtype": "float32", "workers": 2, **kw}
    return ingest_on_ray(
        url,
        paths=[options.pop("corpus")],
        model=str(model_dir),
        chunk_tokens=CHUNK_TOKENS,
        progress=False,
        **options,
    )


def test_two_workers_store_what_one_process_stores(
    cluster, reference, redis_server, tiny_llama_dir, corpus
):
    _, want_report, want = reference
    url = db(redis_server, 2)
    report = on_ray(url, tiny_llama_dir, corpus=corpus)
    assert_same(facts(url), want)
    assert report.doc_ids == want_report.doc_ids and report.sources == want_report.sources
    assert set(report.added) == set(want_report.added)
    assert report.num_chunks == want_report.num_chunks == len(want["chunks"])
    assert {w.worker for w in report.workers} == {"w0", "w1"}  # both took documents
    assert sum(w.documents for w in report.workers) == len(want["docs"])


class KillAtSecondBatch:
    """The default embedder, except that the first worker to embed a second batch of chunks
    dies there (``os._exit``): after that batch's K/V is stored, before its embeddings and the
    document's catalog entry are."""

    def __init__(self, marker: str) -> None:
        self.inner = MiniLMEmbedder()
        self.name, self.dim = self.inner.name, self.inner.dim
        self.marker, self.calls = marker, 0

    def embed(self, texts):
        self.calls += 1
        if self.calls == 2 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return self.inner.embed(texts)


def test_a_worker_killed_mid_document_loses_nothing(
    cluster, reference, redis_server, tiny_llama_dir, corpus, tmp_path
):
    _, _, want = reference
    url = db(redis_server, 3)
    marker = tmp_path / "killed"
    embedder = functools.partial(KillAtSecondBatch, marker)
    # Ray Data restarts the worker and retries its document: the run completes.
    first = on_ray(url, tiny_llama_dir, corpus=corpus, embedder=embedder)
    assert marker.exists()  # a worker died mid-document
    assert_same(facts(url), want)
    # What the dead worker stored was kept: the retried document resumed (repaired) and the
    # run computed fewer chunks than the store holds.
    assert first.repaired and first.reused_chunks > 0
    assert first.num_chunks < len(want["chunks"])


def test_a_rerun_finds_nothing_to_do(cluster, reference, redis_server, tiny_llama_dir, corpus):
    """Over the store one process left (the store the killed run completed is the same one)."""
    url, _, want = reference
    rerun = on_ray(url, tiny_llama_dir, corpus=corpus, workers=1)
    assert rerun.num_chunks == 0 and not rerun.added and not rerun.repaired
    assert rerun.reused_chunks == 0 and set(rerun.skipped) == set(want["docs"])
    assert_same(facts(url), want)


def test_a_worker_with_another_fingerprint_writes_nothing(
    cluster, reference, redis_server, tiny_llama_dir, corpus
):
    url, _, want = reference
    # One worker is enough: the gate holds the store's fingerprint, not a first worker's.
    with pytest.raises(FingerprintMismatchError, match="dtype"):
        on_ray(url, tiny_llama_dir, corpus=corpus, dtype="bfloat16", workers=1)
    assert_same(facts(url), want)
