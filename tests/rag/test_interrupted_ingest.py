"""An ingest killed (SIGKILL, for real, in a child process) between a document's chunk writes
and its catalog entry, or in the middle of a document: ``store verify`` reports the
disagreement and a re-run of ``ingest`` repairs it, computing only the chunks that are not
stored. Ctrl-C (a real SIGINT) says what was kept and exits 130, SIGTERM (a plain ``kill``, a
container stop) the same and exits 143; the re-run resumes, and meanwhile ``ask`` serves none
of the cut document's chunks."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys

import pytest
from helpers import QUIET_FLAGS

from blendkv.cli import main
from blendkv.rag.catalog import DocumentCatalog
from blendkv.rag.documents import content_doc_id
from blendkv.store import KVStore

pytestmark = pytest.mark.slow

# The child ingests a folder with a test-only subclass placed at the crash window; the store,
# the index and the catalog are the real ones, written to disk.
CHILD = r"""
import os, signal, sys
from pathlib import Path
from blendkv import LLM
from blendkv.rag import RAGPipeline
from blendkv.rag.catalog import DocumentCatalog
from blendkv.rag.chunk_store import ChunkStore

model, store, docs, where = sys.argv[1:5]


class KilledBeforeTheThirdCatalogEntry(DocumentCatalog):
    def put(self, doc_id, **entry):
        if len(self.documents()) == 2:  # the third document's chunks are stored and indexed
            os.kill(os.getpid(), signal.SIGKILL)
        super().put(doc_id, **entry)


class KilledAfterTheFirstWriteBatch(ChunkStore):
    def add_chunks(self, chunks):
        results = super().add_chunks(chunks)  # one LMDB transaction, then the index
        os.kill(os.getpid(), signal.SIGKILL)
        return results


llm = LLM(
    model, dtype="float32", enable_prefix_caching=False, warmup=False, blend_cost_check=False
)
rag = RAGPipeline(store, llm=llm, chunk_tokens=16)
if where == "catalog":
    rag.catalog = KilledBeforeTheThirdCatalogEntry(store)
else:
    embedder = rag.store.embedder
    rag.store.close()
    rag.store = KilledAfterTheFirstWriteBatch(store, rag.manager.fingerprint, embedder)
    rag.manager.use_store(rag.store.kv)
rag.ingest([Path(docs)], progress=False)
sys.exit(3)
"""

WORDS = (
    "okapi glacier lighthouse volcano beetle river hill forest harbour meadow lantern copper "
    "violin saffron tundra compass orchard falcon marble quartz walrus cedar ember prairie"
).split()


def prose(seed: int, num_words: int) -> str:
    """Distinct random sentences: no two chunks are equal (equal chunks are stored once)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(num_words)]
    return " ".join(w + ("." if i % 9 == 8 else "") for i, w in enumerate(words))


def write_docs(folder, texts):
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"{i:02d}.txt").write_text(text)
    return [content_doc_id(t) for t in texts]


def run_child(model_dir, store, docs, where):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir), str(store), str(docs), where],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().out


def owned_chunks(store) -> dict[str, list[int]]:
    """doc id -> its stored chunk ids, read straight from LMDB."""
    with KVStore(store, readonly=True) as kv:
        out: dict[str, list[int]] = {}
        for m in kv.iter_meta():
            out.setdefault(m.doc_id, []).append(m.chunk_id)
        return {d: sorted(ids) for d, ids in out.items()}


@pytest.mark.parametrize("where", ["catalog", "batch"])
def test_killed_ingest_is_reported_then_repaired(tiny_llama_dir, tmp_path, capsys, where):
    if where == "catalog":  # five short documents, killed before the third catalog entry
        texts = [prose(seed, 30) for seed in range(5)]
    else:  # one long document (three write batches of 16 chunks), killed after the first
        texts = [prose(99, 200)]
    store, docs = tmp_path / "store", tmp_path / "docs"
    doc_ids = write_docs(docs, texts)
    model = ["--model", str(tiny_llama_dir), "--dtype", "float32", *QUIET_FLAGS]
    ingest = ["ingest", str(docs), "--store", str(store), "--chunk-tokens", "16", "--no-progress"]

    run_child(tiny_llama_dir, store, docs, where)
    interrupted = doc_ids[2] if where == "catalog" else doc_ids[0]
    cataloged = set(DocumentCatalog(store).documents())
    before = owned_chunks(store)
    assert interrupted in before and interrupted not in cataloged
    assert cataloged == (set(doc_ids[:2]) if where == "catalog" else set())

    code, out = cli(capsys, "store", "verify", "--store", str(store), "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert [(p["kind"], p["subject"]) for p in report["problems"]] == [
        ("doc_not_in_catalog", interrupted)
    ]
    code, out = cli(capsys, "store", "stats", "--store", str(store), "--json")
    stats = json.loads(out)
    assert (stats["documents"], stats["stored_documents"]) == (len(cataloged), len(before))
    assert stats["chunks"] == stats["indexed_chunks"]  # the index was saved with the chunks

    code, rerun = cli(capsys, *ingest, *model)
    assert code == 0
    assert f"{interrupted}  repaired" in rerun
    code, out = cli(capsys, "store", "verify", "--store", str(store))
    assert code == 0 and "OK" in out
    code, out = cli(capsys, "store", "stats", "--store", str(store), "--json")
    stats = json.loads(out)
    assert stats["documents"] == stats["stored_documents"] == len(doc_ids)
    assert stats["chunks"] == stats["indexed_chunks"]
    after = owned_chunks(store)
    entries = DocumentCatalog(store).documents()
    assert all(entries[d]["num_chunks"] == len(after[d]) for d in doc_ids)
    if where == "catalog":  # complete chunks: only the catalog entry was written
        assert after[interrupted] == before[interrupted]
        reused = len(before[interrupted])  # documents 3 and 4 were not reached: added now
        assert "2 document(s) added, 1 repaired" in rerun and f"{reused} reused" in rerun
    else:  # the first batch alone: resumed, the stored chunks kept (same ids), not recomputed
        assert len(before[interrupted]) == 16
        assert after[interrupted][:16] == before[interrupted]
        missing = len(after[interrupted]) - 16
        assert missing > 16  # the document needed more than one more batch
        assert f"{missing} chunks computed" in rerun and "16 reused" in rerun

    code, out = cli(capsys, *ingest, *model)
    assert code == 0 and "0 document(s) added" in out and "repaired" not in out


# The CLI itself, with a store that sends the process a real SIGINT (what Ctrl-C sends) after
# the second write batch: KeyboardInterrupt lands in the middle of the second document.
CTRL_C_CHILD = r"""
import os, signal, sys
import blendkv.rag.pipeline
from blendkv.cli import main
from blendkv.rag.chunk_store import ChunkStore

# Ctrl-C as in a terminal, even where the tests run as a background job (SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)


class CtrlCAfterTheSecondWriteBatch(ChunkStore):
    batches = 0

    def add_chunks(self, chunks):
        results = super().add_chunks(chunks)
        type(self).batches += 1
        if type(self).batches == 2:  # the short document's, then the long one's first
            os.kill(os.getpid(), signal.SIGINT)
        return results


blendkv.rag.pipeline.ChunkStore = CtrlCAfterTheSecondWriteBatch
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_says_what_was_kept_and_the_rerun_resumes(tiny_llama_dir, tmp_path, capsys):
    store, docs = tmp_path / "store", tmp_path / "docs"
    texts = [prose(7, 30), prose(8, 200)]  # a short document, then a long one
    doc_ids = write_docs(docs, texts)
    argv = ["ingest", str(docs), "--store", str(store), "--chunk-tokens", "16", "--no-progress"]
    argv += ["--model", str(tiny_llama_dir), "--dtype", "float32", *QUIET_FLAGS]
    proc = subprocess.run(
        [sys.executable, "-c", CTRL_C_CHILD, *argv], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    # The first document fits one batch: stored in full, catalogued; the second was cut.
    said = re.search(
        r"interrupted: 1 document\(s\) stored in full; (\d+) of \d+ chunks of (.+) kept; "
        r"re-run the same ingest to resume",
        proc.stderr,
    )
    assert said and said.group(2) == str(docs / "01.txt"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert set(DocumentCatalog(store).documents()) == {doc_ids[0]}
    before = owned_chunks(store)
    assert len(before[doc_ids[1]]) == 16

    code, out = cli(capsys, *argv)
    after = owned_chunks(store)
    computed = len(after[doc_ids[1]]) - 16
    assert code == 0 and f"{doc_ids[1]}  repaired" in out and f"{computed} chunks computed" in out
    assert f"{said.group(1)} reused from the store" in out  # what Ctrl-C said was kept
    assert after[doc_ids[1]][:16] == before[doc_ids[1]] and after[doc_ids[0]] == before[doc_ids[0]]
    code, out = cli(capsys, "store", "verify", "--store", str(store))
    assert code == 0 and "OK" in out


# The same with SIGTERM, what a plain `kill` and a container stop send: the same message (naming
# the signal), a catalog of complete documents only, the exit status 128 + 15; retrieval never
# returns the cut document's chunks; the re-run resumes.
SIGTERM_CHILD = CTRL_C_CHILD.replace("signal.SIGINT)", "signal.SIGTERM)")


def test_sigterm_is_ctrl_c_and_nothing_half_written_is_served(tiny_llama_dir, tmp_path, capsys):
    store, docs = tmp_path / "store", tmp_path / "docs"
    texts = [prose(7, 30), prose(8, 200)]  # a short document, then a long one
    doc_ids = write_docs(docs, texts)
    model = ["--model", str(tiny_llama_dir), "--dtype", "float32", *QUIET_FLAGS]
    argv = ["ingest", str(docs), "--store", str(store), "--chunk-tokens", "16", "--no-progress"]
    argv += model
    assert "signal.SIGTERM)" in SIGTERM_CHILD
    proc = subprocess.run(
        [sys.executable, "-c", SIGTERM_CHILD, *argv], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    said = re.search(
        r"interrupted by SIGTERM: 1 document\(s\) stored in full; (\d+) of \d+ chunks of (.+) "
        r"kept; re-run the same ingest to resume",
        proc.stderr,
    )
    assert said and said.group(2) == str(docs / "01.txt"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert set(DocumentCatalog(store).documents()) == {doc_ids[0]}
    cut = owned_chunks(store)[doc_ids[1]]
    assert len(cut) == 16  # stored and indexed, in no catalogued document

    ask = ["ask", prose(8, 40), "--store", str(store), "--top-k", "6", "--json"]
    code, out = cli(capsys, *ask, "--max-tokens", "1", *model)
    sources = json.loads(out)["sources"]
    assert code == 0 and sources  # the catalogued document's chunks, and no other
    assert {s["doc_id"] for s in sources} == {doc_ids[0]}
    assert not {s["chunk_id"] for s in sources} & set(cut)

    code, out = cli(capsys, *argv)
    assert code == 0 and f"{doc_ids[1]}  repaired" in out
    assert f"{said.group(1)} reused from the store" in out
    code, out = cli(capsys, "store", "verify", "--store", str(store))
    assert code == 0 and "OK" in out
    code, out = cli(capsys, *ask, "--max-tokens", "1", *model)
    assert doc_ids[1] in {s["doc_id"] for s in json.loads(out)["sources"]}  # catalogued now
