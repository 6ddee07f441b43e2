"""``blendkv ingest PATH... --store DIR``: chunk, embed and precompute documents into a store.

SIGTERM (a plain ``kill``, a container stop) interrupts an ingest as Ctrl-C does: what was
stored is kept, the catalog lists only complete documents, the message says what a re-run
resumes, and the exit status is 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from blendkv.cli import add_model_args, engine_kwargs
from blendkv.errors import InvalidRequestError
from blendkv.sizes import size_arg


def add_store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        required=True,
        metavar="DIR|URL",
        help="chunk-KV store: an LMDB directory, or redis://host:port/db (shared by processes)",
    )


def add_store_max_bytes_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store-max-bytes",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="the store's size limit on disk, e.g. 20G: an LMDB store's file (data.mdb) "
        "stays within it (1M at least); saved in the store (default: the saved one, if any); "
        "past it, chunks no document owns are evicted, then ingest stops",
    )


def open_pipeline(
    args: argparse.Namespace,
    *,
    create: bool,
    chunk_tokens: int = 256,
    enable_prefix_caching: bool = False,
):
    """A RAGPipeline over ``args.store`` with the model options of ``args``.

    A missing store (``create=False``) fails before the model is loaded. The engine's prefix
    cache is off unless asked for, so that every query goes through the chunk store.
    """
    from blendkv import LLM
    from blendkv.engine_args import follow_store_dtype
    from blendkv.rag import RAGPipeline
    from blendkv.store import StoreNotFoundError
    from blendkv.store.redis_store import is_redis_url

    shared = is_redis_url(args.store)
    if not shared and not create and not (Path(args.store) / "data.mdb").exists():
        raise StoreNotFoundError(
            f"no blendkv store at {args.store}; create one with `blendkv ingest PATH --store DIR`"
        )
    # dtype auto follows the store's (engine_args.follow_store_dtype).
    options = follow_store_dtype(engine_kwargs(args), args.store)
    llm = LLM(args.model, enable_prefix_caching=enable_prefix_caching, **options)
    try:
        return RAGPipeline(
            args.store,
            llm=llm,
            chunk_tokens=chunk_tokens,
            create=create,
            store_max_bytes=getattr(args, "store_max_bytes", None),
        )
    except BaseException:
        llm.close()
        raise


def register(sub) -> None:
    p = sub.add_parser("ingest", help="add .txt/.md files or folders to a chunk-KV store")
    p.add_argument(
        "paths",
        nargs="+",
        help="files, folders (.txt/.md, searched recursively) or quoted globs ('docs/**/*.md')",
    )
    add_store_arg(p)
    add_store_max_bytes_arg(p)
    p.add_argument("--chunk-tokens", type=int, default=256, help="target chunk length in tokens")
    p.add_argument(
        "--strict",
        action="store_true",
        help="stop at an unreadable file inside a folder (default: skip it with a warning)",
    )
    p.add_argument(
        "--keep-old-versions",
        action="store_true",
        help="keep the stored version of a file whose content changed (default: replace it)",
    )
    p.add_argument(
        "--calibrate",
        nargs="?",
        type=float,
        const=600.0,
        default=None,
        metavar="SECONDS",
        help="then calibrate the store for fidelity targets, as `blendkv calibrate` with its "
        "defaults, for at most SECONDS (default 600; at least 2 prompts)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_worker_args(p)
    add_model_args(p)
    p.set_defaults(func=run)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    ray = p.add_argument_group("distributed ingest on Ray Data (pip install 'blendkv[ray]')")
    ray.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="ingest on N Ray workers, each with its own engine, into a shared --store "
        "redis://... (default: in this process)",
    )
    ray.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to run on ('auto': the one running here; default: start a local one)",
    )
    ray.add_argument(
        "--worker-cpus", type=float, default=1.0, help="CPUs each worker takes (default 1)"
    )
    ray.add_argument(
        "--worker-gpus", type=float, default=0.0, help="GPUs each worker takes (default 0)"
    )


def run(args: argparse.Namespace) -> int:
    from blendkv.rag.documents import load_inputs
    from blendkv.rag.ingest import IngestInterrupted

    _check_calibrate(args)
    if args.workers is not None:
        return _run_on_ray(args)
    # Read and validate every file before loading the model; the pipeline ingests what was read.
    loaded = load_inputs(paths=args.paths, strict=args.strict)
    for s in loaded.skipped:
        print(f"warning: skipped {s.path}: {s.reason}", file=sys.stderr)
    pipeline = open_pipeline(args, create=True, chunk_tokens=args.chunk_tokens)
    try:
        received: list[int] = []
        try:
            with sigterm_interrupts(received):
                report = pipeline.ingest(
                    loaded,
                    replace=not args.keep_old_versions,
                    progress=not args.no_progress,
                    on_plan=lambda plan: print(plan.describe(), flush=True),
                )
        except IngestInterrupted as e:
            print(f"\n{e.message(_name(received))}", file=sys.stderr)
            return 128 + (received[0] if received else signal.SIGINT)
        except KeyboardInterrupt:
            print(
                f"\ninterrupted{_by(received)}: what was stored is kept; re-run the same "
                "command to resume",
                file=sys.stderr,
            )
            return 128 + (received[0] if received else signal.SIGINT)
        _print_report(report)
        print(
            f"store {args.store}: {len(pipeline.store.kv)} chunks, "
            f"{len(pipeline.documents())} documents"
        )
        if args.calibrate is not None:
            from blendkv.guards.calibration import calibrate_store

            print(calibrate_store(pipeline, seconds=args.calibrate, progress=not args.no_progress))
        else:
            from blendkv.guards.calibration import uncalibrated_note

            note = uncalibrated_note(pipeline.manager, args.store)
            if note is not None:
                print(note)
    finally:
        pipeline.close()
        pipeline.llm.close()
    return 0


def _check_calibrate(args: argparse.Namespace) -> None:
    """``--calibrate`` runs in this process after the ingest: not with ``--workers`` (run
    ``blendkv calibrate`` on the store after); refused before any document is read."""
    if args.calibrate is None:
        return
    if args.calibrate < 0:
        raise InvalidRequestError(f"--calibrate takes seconds >= 0, got {args.calibrate}")
    if args.workers is not None:
        raise InvalidRequestError(
            "--calibrate runs in this process: not with --workers (run `blendkv calibrate "
            "--store ...` after the ingest)"
        )


@contextmanager
def sigterm_interrupts(received: list[int]) -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt`` in the main thread, as Ctrl-C
    does, and is appended to ``received``; the old handler is restored after. Elsewhere than
    in the main thread (where Python runs signal handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _name(received: list[int]) -> str | None:
    return signal.Signals(received[0]).name if received else None


def _by(received: list[int]) -> str:
    return f" by {_name(received)}" if received else ""


def _run_on_ray(args: argparse.Namespace) -> int:
    from blendkv.rag.distributed import ingest_on_ray

    report = ingest_on_ray(
        args.store,
        paths=args.paths,
        workers=args.workers,
        model=args.model,
        chunk_tokens=args.chunk_tokens,
        strict=args.strict,
        replace=not args.keep_old_versions,
        progress=not args.no_progress,
        worker_cpus=args.worker_cpus,
        worker_gpus=args.worker_gpus,
        ray_address=args.ray_address,
        **engine_kwargs(args),
    )
    for s in report.skipped_files:
        print(f"warning: skipped {s.path}: {s.reason}", file=sys.stderr)
    _print_report(report)
    return 0


def _print_report(report) -> None:
    """One line per document (doc id, what happened, source), replaced versions, the summary."""
    replaced: dict[str, list[str]] = {}
    for old, new in report.replaced:
        replaced.setdefault(new, []).append(old)
    for doc_id, source in zip(report.doc_ids, report.sources, strict=True):
        state = (
            "added"
            if doc_id in report.added
            else "repaired"
            if doc_id in report.repaired
            else "already stored"
        )
        print(f"{doc_id}  {state:14s}  {source}")
        for old in replaced.pop(doc_id, []):
            print(f"{old}  {'replaced':14s}  {source} (older version, removed)")
    print(report.summary())
