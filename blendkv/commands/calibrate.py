"""``blendkv calibrate --store DIR``: how far blends drift from full prefill on the store's own
chunks, per recompute ratio, saved beside the store for ``BlendConfig(fidelity_target=...)``
(:mod:`blendkv.guards.calibration`)."""

from __future__ import annotations

import argparse

from blendkv.cli import add_model_args
from blendkv.commands.ingest import add_store_arg
from blendkv.errors import InvalidRequestError
from blendkv.guards.calibration import CONFIDENT_PROMPTS, DEFAULT_PROMPTS


def register(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure blends against full prefill on a store's chunks, per recompute ratio",
    )
    add_store_arg(p)
    p.add_argument(
        "--prompts",
        type=int,
        default=DEFAULT_PROMPTS,
        help=f"prompts to measure (default {DEFAULT_PROMPTS}; {CONFIDENT_PROMPTS} or more bound "
        "the 90th percentile with 95%% confidence)",
    )
    p.add_argument(
        "--chunks-per-prompt",
        type=int,
        default=6,
        help="stored chunks in each prompt of random chunks (not with --questions)",
    )
    p.add_argument(
        "--questions",
        default=None,
        metavar="FILE",
        help="calibrate on your own questions (one per line; the first --prompts of them), each "
        "over the chunks it retrieves, instead of random chunk sets with generic questions",
    )
    p.add_argument(
        "--top-k", type=int, default=6, help="chunks each question retrieves (with --questions)"
    )
    p.add_argument(
        "--ratios",
        default="0,0.05,0.1,0.2,0.3,0.5",
        help="recompute ratios measured, comma-separated, ascending in [0, 1)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="stop after this long (at least 2 prompts are measured)",
    )
    p.add_argument("--seed", type=int, default=0, help="which chunks and questions are drawn")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blendkv.commands.ingest import open_pipeline
    from blendkv.guards.calibration import calibrate_store

    try:
        ratios = tuple(float(r) for r in args.ratios.split(","))
    except ValueError as exc:
        raise InvalidRequestError(f"--ratios takes numbers, got {args.ratios!r}") from exc
    if args.prompts < 2:
        raise InvalidRequestError(f"--prompts must be >= 2, got {args.prompts}")
    questions = _questions(args.questions) if args.questions else None
    if args.top_k < 1:
        raise InvalidRequestError(f"--top-k must be >= 1, got {args.top_k}")
    pipeline = open_pipeline(args, create=False, enable_prefix_caching=True)
    try:
        report = calibrate_store(
            pipeline,
            ratios=ratios,
            prompts=args.prompts,
            chunks_per_prompt=args.chunks_per_prompt,
            questions=questions,
            top_k=args.top_k,
            seconds=args.seconds,
            seed=args.seed,
            progress=not args.no_progress,
        )
        print(report)
    finally:
        pipeline.close()
        pipeline.llm.close()
    return 0


def _questions(path: str) -> list[str]:
    """The questions of a file, one per line (blank lines skipped); at least 2."""
    try:
        with open(path, encoding="utf-8") as f:
            questions = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"--questions: cannot read {path}: {exc}") from exc
    if len(questions) < 2:
        raise InvalidRequestError(
            f"--questions: {path} holds {len(questions)} question(s); a calibration needs 2"
        )
    return questions
