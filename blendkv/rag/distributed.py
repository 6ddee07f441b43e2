"""Ingest on many workers: Ray Data reads, chunks, embeds and prefills a corpus into one store.

    paths ──▶ input_files (the driver lists the files; nothing is read yet)
          ──▶ Ray Data ``map``: each file read on a worker ──▶ its doc id (a hash of its text)
          ──▶ the driver keeps each doc id's first occurrence (what one process ingests)
          ──▶ Ray Data ``map_batches`` on N actors, each with its own engine and a RAGPipeline
              over the shared store: one document per call, through the same DocumentIngester
              as ``RAGPipeline.ingest`` (chunk, prefill, store, embed, catalog)
          ──▶ one row per document back to the driver as it finishes: one progress bar with
              each worker's rate

Why the store comes out the same as a single-process ingest of the same files: chunk keys are
content-addressed (model fingerprint + anchor + token ids), each document is ingested whole by
one worker with the single-process code, a chunk two workers compute (a chunk two documents
share) is stored once (:meth:`RedisKVStore.put_many <blendkv.store.redis_store.RedisKVStore>`
watches its marker), the catalog is a Redis hash with one field per document, and FAISS is per
process, rebuilt from the embeddings kept beside the chunks. Only chunk ids (the store's
counter) follow the order the workers stored in.

A worker killed mid-document loses nothing stored: each chunk is one ``MULTI``, and the
document has no catalog entry yet. Ray Data restarts the actor and retries the document (or a
re-run does): DocumentIngester's resume path computes only the chunks not stored, and a
worker that opens the store re-embeds a chunk whose embedding the dead one never wrote.

Before anything is written, every worker checks its model fingerprint against a gate (the
store's own; for a new store, the first worker's): Ray Data starts every actor before the
first document (``DataContext.wait_for_min_actors_s``), so a worker with another model, dtype
or anchor fails the job before any chunk is stored.

The store must be shared (``redis://``): an LMDB store's index file and catalog file have one
writer.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blendkv.errors import ConfigError
from blendkv.rag.documents import (
    InputFile,
    LoadedInputs,
    SkippedFile,
    SourceDocument,
    check_folders_read,
    content_doc_id,
    input_files,
    load_inputs,
    read_input_file,
)
from blendkv.rag.errors import DocumentError, EmptyDocumentError, UnreadableDocumentError
from blendkv.rag.types import IngestReport

# The workers that read files import this module: the store's modules (which load torch) are
# imported where they are used, by the driver and the ingest workers.

logger = logging.getLogger(__name__)

RAY_MISSING = "needs Ray: pip install 'blendkv[ray]'"
START_TIMEOUT_S = 900  # how long the workers may take to load their engines


def import_ray(what: str):
    """``ray``, or a ConfigError saying that ``what`` needs it and what to install."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"{what} {RAY_MISSING} ({exc})") from exc
    return ray


@dataclass(frozen=True)
class WorkerRate:
    """One worker's share of a distributed ingest: documents, chunks computed and the seconds
    its engine spent on them."""

    worker: str
    documents: int
    chunks: int
    seconds: float

    @property
    def chunks_per_second(self) -> float:
        return self.chunks / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class DistributedIngestReport(IngestReport):
    """:class:`~blendkv.rag.types.IngestReport` of a distributed ingest, plus each worker's
    rate (``workers``, in the order they first reported)."""

    workers: tuple[WorkerRate, ...] = ()

    def summary(self) -> str:
        rates = ", ".join(
            f"{w.worker} {w.chunks} chunks at {w.chunks_per_second:.1f}/s" for w in self.workers
        )
        return super().summary() + (f"; workers: {rates}" if rates else "")


def ingest_on_ray(
    store: str,
    documents: Any = None,
    *,
    paths: Any = None,
    texts: Any = None,
    metadata: dict | None = None,
    workers: int = 2,
    model: str | None = None,
    chunk_tokens: int = 256,
    strict: bool = False,
    replace: bool = True,
    progress: bool = True,
    embedder: Callable[[], Any] | None = None,
    worker_cpus: float = 1.0,
    worker_gpus: float = 0.0,
    ray_address: str | None = None,
    **engine_options,
) -> DistributedIngestReport:
    """:meth:`RAGPipeline.ingest <blendkv.rag.RAGPipeline.ingest>` on ``workers`` Ray workers
    into the shared store ``store`` (``redis://...``); see the module docstring.

    Inputs as ``RAGPipeline.ingest`` takes them (``paths=`` files are read on the workers);
    ``metadata``: one dict for every document. ``model`` and ``engine_options`` are each
    worker's ``LLM`` (default: the embedded SmolLM2; on the CPU each engine uses
    ``worker_cpus`` threads unless ``num_threads`` says otherwise). ``embedder``: a callable
    each worker calls for its embedder (default all-MiniLM-L6-v2). ``worker_cpus`` and
    ``worker_gpus`` are each worker's Ray resources. Uses the Ray cluster this process is
    connected to, else ``ray_address`` (``"auto"``: a running one), else starts a local one.
    """
    _check_ingest_args(store, workers, metadata)
    ray = import_ray("a distributed ingest (--workers)")
    t0 = time.perf_counter()
    rows = _input_rows(documents, paths, texts)  # before Ray starts: bad inputs fail fast
    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=False)
    if worker_gpus == 0 and "num_threads" not in engine_options:
        engine_options["num_threads"] = max(1, int(worker_cpus))
    with _data_context(ray) as ctx:
        read, keep, skipped_files = _read(ray, rows, strict)
        worker_args = dict(
            store=store,
            model=model,
            engine_options=engine_options,
            chunk_tokens=chunk_tokens,
            embedder=embedder,
            gate=_fingerprint_gate(ray, store),
            replace=replace,
            metadata=json.dumps(metadata or {}),
            keep=keep,
        )
        results = _ingest_dataset(ray, read, worker_args, workers, worker_cpus, worker_gpus)
        done = _collect(results, len(keep), progress, ctx)
    return _report(read, done, skipped_files, time.perf_counter() - t0)


def _check_ingest_args(store: str, workers: object, metadata: object) -> None:
    """Raise on a store that is not shared, a bad worker count or metadata not one dict."""
    from blendkv.store.redis_store import is_redis_url

    if not is_redis_url(store):
        raise ConfigError(
            f"a distributed ingest writes to a shared store: give --store redis://HOST:PORT/DB, "
            f"not {store!r} (an LMDB store's index and catalog files have one writer)"
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}")
    if metadata is not None and not isinstance(metadata, dict):
        raise DocumentError("metadata must be one dict (for every document)")


def _fingerprint_gate(ray, store: str):
    """The actor every worker checks its model fingerprint with (the store's, else the first
    worker's)."""
    return ray.remote(num_cpus=0)(_FingerprintGate).remote(_stored_fingerprint_json(store))


def _ingest_dataset(
    ray, read, worker_args: dict, workers: int, worker_cpus: float, worker_gpus: float
):
    """The read dataset mapped through ``workers`` ingest actors: one result row per
    document kept (lazy; iterating it runs the ingest)."""
    # The workers drop the rows not kept themselves: a filter before them would be tasks
    # needing CPUs that the workers hold.
    return read.map_batches(
        _IngestWorker,
        fn_constructor_kwargs=worker_args,
        # Two documents in flight per worker: the next one waits while one is ingested.
        compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=2),
        batch_size=1,
        num_cpus=worker_cpus,
        num_gpus=worker_gpus,
    )


# ----------------------------------------------------------------------------- reading
def _input_rows(documents, paths, texts) -> list[dict]:
    """One row per input, in ``load_inputs``' order (``documents``, ``paths``, ``texts``):
    a text read already, or a file to read on a worker."""
    rows: list[dict] = []

    def text_rows(loaded: LoadedInputs) -> None:
        for d in loaded.documents:
            rows.append(_row(len(rows), text=d.text, source=d.source, metadata=d.metadata))

    if documents is not None:
        text_rows(load_inputs(documents))
    for f in input_files(paths):
        rows.append(_row(len(rows), path=str(f.path), where=f.where))
    if texts is not None:
        text_rows(load_inputs(texts=texts))
    if not rows:
        raise EmptyDocumentError("no documents given")
    return rows


def _row(index: int, *, text=None, source=None, metadata=None, path=None, where=None) -> dict:
    return {
        "index": index,
        "path": path or "",
        "where": where or "",
        "text": text or "",
        "source": source or "",
        "metadata": json.dumps(metadata or {}),
    }


def _read_row(row: dict, strict: bool) -> dict:
    """A Ray Data ``map`` on a worker: reads a file row; every row gets its doc id. A file
    that cannot be read becomes a skip, or an error the driver raises (the error's type and
    message survive, unlike an exception raised inside Ray)."""
    row = {**row, "doc_id": "", "skipped": "", "error": "", "error_type": ""}
    if row["path"]:
        f = InputFile(Path(row["path"]), row["where"] or None)
        try:
            got = read_input_file(f, strict)
        except (DocumentError, OSError) as e:
            return {**row, "error": str(e), "error_type": type(e).__name__}
        if isinstance(got, SkippedFile):
            return {**row, "skipped": got.reason, "source": got.path}
        row.update(text=got.text, source=got.source or "")
    if not row["text"].strip():
        name = row["source"] or row["index"]
        return {**row, "error": f"document {name} is empty", "error_type": "EmptyDocumentError"}
    return {**row, "doc_id": content_doc_id(row["text"])}


def _read(ray, rows: list[dict], strict: bool):
    """Read every input on the workers; returns (the read dataset, the indices of the rows to
    ingest: each doc id's first, the skipped files). Raises what reading raised."""
    read = ray.data.from_items(rows).map(_read_row, fn_kwargs={"strict": strict}).materialize()
    columns = ["index", "path", "where", "source", "doc_id", "skipped", "error", "error_type"]
    facts = sorted(read.select_columns(columns).take_all(), key=lambda r: r["index"])
    for r in facts:
        if r["error"]:
            raise _ERRORS.get(r["error_type"], UnreadableDocumentError)(r["error"])
    files = [InputFile(Path(r["path"]), r["where"] or None) for r in facts if r["path"]]
    got = [
        SkippedFile(r["source"], r["skipped"]) if r["skipped"] else SourceDocument("", None)
        for r in facts
        if r["path"]
    ]
    check_folders_read(files, got)
    keep, seen = [], set()
    for r in facts:
        if r["skipped"]:
            logger.warning("skipped %s: %s", r["source"], r["skipped"])
        elif r["doc_id"] not in seen:
            seen.add(r["doc_id"])
            keep.append(r["index"])
    skipped = tuple(SkippedFile(r["source"], r["skipped"]) for r in facts if r["skipped"])
    return read, keep, skipped


_ERRORS = {
    "EmptyDocumentError": EmptyDocumentError,
    "UnreadableDocumentError": UnreadableDocumentError,
    "DocumentError": DocumentError,
}


# ---------------------------------------------------------------------------- workers
class _FingerprintGate:
    """A Ray actor: the fingerprint every worker must have (the store's, else the first
    worker's)."""

    def __init__(self, reference: str | None) -> None:
        self.reference = reference

    def check(self, fingerprint: str) -> str | None:
        """None when ``fingerprint`` is the reference, else the reference."""
        if self.reference is None:
            self.reference = fingerprint
        return None if fingerprint == self.reference else self.reference


def _stored_fingerprint_json(store: str) -> str | None:
    from blendkv.store.backends import stored_fingerprint

    fp = stored_fingerprint(store)
    return None if fp is None else fp.to_json()


class _IngestWorker:
    """A Ray Data actor: one engine and one RAGPipeline over the shared store; ingests one
    document per call."""

    def __init__(
        self, store, model, engine_options, chunk_tokens, embedder, gate, replace, metadata, keep
    ) -> None:
        import ray

        from blendkv import LLM
        from blendkv.rag.pipeline import DEFAULT_INSTRUCTION
        from blendkv.store import ModelFingerprint
        from blendkv.store.errors import FingerprintMismatchError
        from blendkv.store.fingerprint import mismatch_message

        self.store, self.chunk_tokens, self.replace = store, chunk_tokens, replace
        self.embedder = embedder() if embedder is not None else None
        self.metadata = json.loads(metadata)
        self.keep = set(keep)  # the input rows to ingest (each doc id's first)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.llm = LLM(model, **{"enable_prefix_caching": False, **engine_options})
        # The fingerprint the pipeline will open the store with (RAGPipeline._anchor).
        manager = self.llm.blend_manager()
        manager.anchor_for_store(store, manager.builder.anchor(None, DEFAULT_INSTRUCTION))
        mine = manager.fingerprint
        reference = ray.get(gate.check.remote(mine.to_json()))
        if reference is not None:
            theirs = ModelFingerprint.from_json(reference)
            self.llm.close()
            raise FingerprintMismatchError(
                f"worker {self.name}: " + mismatch_message(store, mine, theirs), mine.diff(theirs)
            )
        self.rag = None  # opened at the first document: nothing is written before every check

    def __call__(self, batch: dict) -> dict:
        from blendkv.rag import RAGPipeline

        if self.rag is None:
            self.rag = RAGPipeline(
                self.store, llm=self.llm, embedder=self.embedder, chunk_tokens=self.chunk_tokens
            )
        out: dict[str, list] = {k: [] for k in _RESULT_COLUMNS}
        for text, source, meta, index in zip(
            batch["text"], batch["source"], batch["metadata"], batch["index"], strict=True
        ):
            if int(index) not in self.keep:
                continue
            doc = SourceDocument(str(text), str(source) or None, json.loads(str(meta)))
            t0 = time.perf_counter()
            report = self.rag.ingest(
                LoadedInputs((doc,)),
                metadata=self.metadata or None,
                progress=False,
                replace=self.replace,
            )
            [doc_id] = report.doc_ids
            state = "added" if report.added else "repaired" if report.repaired else "skipped"
            row = dict(
                index=int(index),
                doc_id=doc_id,
                state=state,
                chunks=report.num_chunks,
                tokens=report.num_tokens,
                reused=report.reused_chunks,
                replaced=json.dumps([list(p) for p in report.replaced]),
                worker=self.name,
                seconds=time.perf_counter() - t0,
            )
            for k in _RESULT_COLUMNS:
                out[k].append(row[k])
        return out

    def __del__(self) -> None:
        rag, llm = getattr(self, "rag", None), getattr(self, "llm", None)
        if rag is not None:
            rag.close()
        if llm is not None:
            llm.close()


# What a worker returns per document (Ray Data columns).
_RESULT_COLUMNS = ("index", "doc_id", "state", "chunks", "tokens", "reused", "replaced")
_RESULT_COLUMNS += ("worker", "seconds")


# ------------------------------------------------------------------------ the driver
class _data_context:
    """Ray Data's context for this ingest: no progress bars of its own (the ingest shows
    one), every actor started before the first document (the fingerprint gate)."""

    def __init__(self, ray) -> None:
        self.ctx = ray.data.DataContext.get_current()

    def __enter__(self):
        c = self.ctx
        self.saved = (c.enable_progress_bars, c.wait_for_min_actors_s, c.print_on_execution_start)
        c.enable_progress_bars = False
        c.print_on_execution_start = False
        c.wait_for_min_actors_s = START_TIMEOUT_S
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        return c

    def __exit__(self, *exc) -> None:
        c = self.ctx
        c.enable_progress_bars, c.wait_for_min_actors_s, c.print_on_execution_start = self.saved


def _collect(results, total: int, progress: bool, ctx) -> list[dict]:
    """The workers' rows as they finish, behind one bar of documents with each worker's rate."""
    from tqdm.auto import tqdm

    rows: list[dict] = []
    chunks: dict[str, int] = {}
    seconds: dict[str, float] = {}
    bar = tqdm(total=total, desc="ingest", unit="doc", disable=not progress)
    try:
        for row in results.iter_rows():
            rows.append(row)
            w = row["worker"]
            chunks[w] = chunks.get(w, 0) + int(row["chunks"])
            seconds[w] = seconds.get(w, 0.0) + float(row["seconds"])
            names = _worker_names(rows)
            bar.set_postfix_str(
                ", ".join(
                    f"{names[w]} {chunks[w] / max(seconds[w], 1e-9):.1f} chunk/s" for w in chunks
                ),
                refresh=False,
            )
            bar.update(1)
    except Exception as exc:
        raise _unwrapped(exc) from exc
    finally:
        bar.close()
    return rows


def _worker_names(rows: list[dict]) -> dict[str, str]:
    """worker (host:pid) -> w0, w1, ... in the order they first reported."""
    names: dict[str, str] = {}
    for r in rows:
        names.setdefault(r["worker"], f"w{len(names)}")
    return names


def _unwrapped(exc: Exception) -> Exception:
    """A fingerprint mismatch raised in a worker, as itself (Ray wraps what actors raise)."""
    from blendkv.store.errors import FingerprintMismatchError

    text = str(exc)
    if "FingerprintMismatchError" in text:
        message = text.split("FingerprintMismatchError:", 1)[-1].strip()
        return FingerprintMismatchError(message.splitlines()[0] if message else text, {})
    return exc


def _report(read, rows: list[dict], skipped_files, seconds: float) -> DistributedIngestReport:
    inputs = sorted(
        read.select_columns(["index", "doc_id", "source", "skipped"]).take_all(),
        key=lambda r: r["index"],
    )
    inputs = [r for r in inputs if not r["skipped"]]
    state = {r["doc_id"]: r["state"] for r in sorted(rows, key=lambda r: r["index"])}
    names = _worker_names(rows)
    per_worker: dict[str, list[dict]] = {}
    for r in rows:
        per_worker.setdefault(r["worker"], []).append(r)
    ids = [r["doc_id"] for r in inputs]
    return DistributedIngestReport(
        doc_ids=tuple(ids),
        added=tuple(d for d in state if state[d] == "added"),
        skipped=tuple(d for d in ids if state.get(d) == "skipped"),
        num_chunks=sum(int(r["chunks"]) for r in rows),
        num_tokens=sum(int(r["tokens"]) for r in rows),
        seconds=seconds,
        repaired=tuple(d for d in state if state[d] == "repaired"),
        sources=tuple(r["source"] or None for r in inputs),
        reused_chunks=sum(int(r["reused"]) for r in rows),
        replaced=tuple(tuple(p) for r in rows for p in json.loads(r["replaced"])),
        skipped_files=skipped_files,
        workers=tuple(
            WorkerRate(
                names[w],
                len(rs),
                sum(int(r["chunks"]) for r in rs),
                sum(float(r["seconds"]) for r in rs),
            )
            for w, rs in per_worker.items()
        ),
    )
