"""``blendkv eval --data FILE|synthetic --methods full,reuse,blend@0.15 --out DIR``.

Runs every method on every example (see ``blendkv.eval.runner``), writes results.json,
per_example.jsonl, report.md and plots into ``--out`` and prints the report table. Finished
examples go to ``--out`` as they finish; ``--resume`` continues an interrupted run there.

The CLI finds this command through the ``blendkv.commands`` entry-point group (pyproject.toml),
so the engine never imports the harness.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from blendkv.commands.config_args import add_config_args
from blendkv.config import EngineConfig
from blendkv.connector.config import BlendConnectorConfig
from blendkv.errors import ConfigError


def register_eval(sub) -> None:
    """Add the ``eval`` command to the CLI's subparsers ``sub``."""
    p = sub.add_parser(
        "eval", help="quality and TTFT of full prefill, prefix caching, reuse and blending"
    )
    _add_run_args(p)
    _add_prompt_args(p)
    _add_report_args(p)
    p.set_defaults(func=run)


def _add_run_args(p) -> None:
    """The data, the methods, the model and the answers compared."""
    p.add_argument("--data", required=True, help="'synthetic', a CacheBlend .json or a .jsonl")
    p.add_argument(
        "--methods",
        default="full,reuse,blend@0.15",
        help="comma-separated: full, prefix, reuse, default (BlendConfig() as shipped), hf, "
        "blend@R (R in [0, 1]), blend@R:SELECTION[+OPTIONS] (v_deviation, k_deviation, "
        "attention, random, prophet, heads; default prophet with the K correction), target@T "
        "(BlendConfig(fidelity_target=T): the engine picks the ratio for T nats)",
    )
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N examples")
    p.add_argument(
        "--offset",
        type=int,
        default=0,
        help="skip the first N examples (a slice: --offset 40 --limit 10 is examples 41-50)",
    )
    add_config_args(p, EngineConfig, ("model", "dtype", "device", "attention_backend"))
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data set")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per answer")
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=16,
        help="tokens of full prefill's answer the teacher-forced KL follows",
    )
    p.add_argument(
        "--fidelity-target",
        type=float,
        default=None,
        metavar="NATS",
        help="report per method the fraction of examples whose largest next-token KL over the "
        "first 16 answer tokens is within NATS (default: a target@T method's own T, "
        "0.5 for the others; fewer tokens with a smaller --answer-tokens)",
    )
    p.add_argument(
        "--calibrate",
        type=int,
        default=0,
        metavar="N",
        help="before the run, calibrate the store for target@T methods on N prompts of random "
        "passages of the first N examples (with the calibration's own questions) and save it "
        "beside the store; default 0: default and target@T run at the store's calibration, or "
        "uncalibrated at ratio 0.3",
    )
    p.add_argument(
        "--calibrate-on",
        default="passages",
        choices=["passages", "questions"],
        help="what --calibrate measures: random sets of the first N examples' passages with "
        "the calibration's own questions, or those N examples' own prompts with their "
        "questions (as `blendkv calibrate --questions` measures a sample of your traffic)",
    )
    add_config_args(p, EngineConfig, ("max_model_len",))


def _add_prompt_args(p) -> None:
    """How the prompts are laid out and their chunks stored."""
    p.add_argument(
        "--anchor",
        default="prompt",
        choices=["prompt", "template", "generic"],
        help="what chunks are precomputed behind after the chat template's prefix: the "
        "prompt's own instruction (default), nothing, or a generic instruction",
    )
    p.add_argument(
        "--anchor-boundary",
        type=int,
        default=0,
        metavar="N",
        help="also precompute each chunk behind the last N tokens of the chunk before it",
    )
    p.add_argument(
        "--chunk-order",
        default="source",
        help="passage order in the prompt: the data set's (source, default), or ranked by the "
        "RAG pipeline's embedder against the question: relevance_first, relevance_last",
    )
    add_config_args(p, BlendConnectorConfig, ("kv_store_dir",))
    p.add_argument(
        "--kv-codec",
        default="none",
        metavar="CODECS",
        help="stored-K/V codecs, comma-separated (none, int8, int4): reuse and blend methods "
        "run once per codec, from a store of that codec, as METHOD[codec]",
    )


def _add_report_args(p) -> None:
    """The report's baseline, the reference cache, progress and resuming."""
    p.add_argument(
        "--baseline",
        default=None,
        metavar="METHOD",
        help="the method the report's bootstrap intervals compare every method with "
        "(default: the default blend, when the run has it)",
    )
    p.add_argument(
        "--reference-cache",
        default=None,
        metavar="DIR",
        help="keep full prefill's answer and logits per prompt in DIR and read them back in "
        "later runs of the same model and settings: only the other methods run (full's TTFT "
        "is then the one measured when it was stored)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run journaled in --out (same settings; --limit may grow)",
    )


def run(args: argparse.Namespace) -> int:
    from blendkv.eval.journal import Journal
    from blendkv.eval.reference_cache import reference_notice
    from blendkv.eval.report import format_intervals, format_table, interval_rows, write_outputs
    from blendkv.eval.runner import EvalConfig, run_eval

    config = EvalConfig(
        data=args.data,
        methods=args.methods,
        limit=args.limit,
        offset=args.offset,
        model=args.model,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        seed=args.seed,
        answer_tokens=args.answer_tokens,
        max_model_len=args.max_model_len,
        kv_store_dir=args.kv_store_dir,
        device=args.device,
        attention_backend=args.attention_backend,
        anchor=args.anchor,
        anchor_boundary=args.anchor_boundary,
        chunk_order=args.chunk_order,
        kv_codecs=args.kv_codec,
        reference_cache=args.reference_cache,
        fidelity_target=args.fidelity_target,
        calibrate=args.calibrate,
        calibrate_on=args.calibrate_on,
    )  # validates the method names before the model loads
    names = [m.name for m, _ in config.variants]
    if args.baseline is not None and args.baseline not in names:
        raise ConfigError(
            f"--baseline {args.baseline!r} is not one of --methods ({', '.join(names)})"
        )
    journal = Journal(args.out, asdict(config), names, args.resume)
    if journal.records:
        n = len(journal.done_ids)
        print(f"resuming: {n} example(s) already in {args.out}", file=sys.stderr)
    try:
        result = run_eval(config, progress=not args.no_progress, journal=journal)
    except KeyboardInterrupt:
        n = len(journal.done_ids)
        print(
            f"\ninterrupted: {n} example(s) saved in {args.out}; rerun with --resume to go on",
            file=sys.stderr,
        )
        return 130
    paths = write_outputs(args.out, result, args.baseline)
    print(format_table(result.summary))
    print("\n" + format_intervals(interval_rows(result.records, args.baseline)))
    notice = reference_notice(result.records)
    if notice:
        print("\n" + notice)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0
