"""``blendkv ask "question" --store DIR``: answer from stored chunks with blended K/V.

``--show-prompt`` prints the assembled prompt with its pieces marked (template, instruction,
each chunk, query); ``--compare-full`` runs full prefill beside the blend on the same tokens and
prints both answers, both TTFTs and the teacher-forced answer KL between them (see
:mod:`blendkv.rag.explain`). With ``--json`` both go into the JSON object (``prompt``,
``compare_full``).
"""

from __future__ import annotations

import argparse
import json
import sys

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.cli import add_model_args
from blendkv.commands.generate import add_penalty_args, penalty_kwargs
from blendkv.commands.ingest import add_store_arg, open_pipeline
from blendkv.errors import InvalidRequestError


def register(sub) -> None:
    p = sub.add_parser("ask", help="answer a question from a chunk-KV store (blended prefill)")
    p.add_argument("question")
    add_store_arg(p)
    p.add_argument("--top-k", type=int, default=6, help="chunks retrieved (default 6)")
    p.add_argument(
        "--chunk-order",
        default=None,
        help="order of the chunks in the prompt: relevance_last (the most relevant next to the "
        "question; the default), relevance_first or source (by document, in reading order)",
    )
    p.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="recompute ratio (default: the engine picks it for the default fidelity target)",
    )
    p.add_argument(
        "--fidelity-target",
        type=float,
        default=None,
        metavar="NATS",
        help="let the engine pick the ratio: the least whose calibrated drift from full "
        "prefill stays within NATS (blendkv calibrate; not with --ratio)",
    )
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="retrieve only from documents whose source, doc_id or metadata KEY is VALUE "
        "(repeatable: different keys must all match, a repeated key matches any of its values)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--show-prompt",
        action="store_true",
        help="print the assembled prompt: template, chunk boundaries and query marked",
    )
    p.add_argument(
        "--compare-full",
        action="store_true",
        help="also run full prefill on the same prompt: both greedy answers, both TTFTs and "
        "the teacher-forced answer KL (blend vs full)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="after the answer, check it against full prefill of the same prompt tokens: "
        "whether the greedy answers differ and the largest next-token KL along them",
    )
    # Sampling (not generate's options: there --top-k is the sampler's, here retrieval's).
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    add_penalty_args(p)
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Validate before loading the model.
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        **penalty_kwargs(args),
    )
    filter = _check_retrieval_args(args)
    blend = _blend_config(args)
    # The comparison's teacher-forced requests reuse each run's own prompt K/V through the
    # prefix cache (as `blendkv eval` does); every timed run starts from an empty cache.
    warm = args.compare_full or args.verify
    pipeline = open_pipeline(args, create=False, enable_prefix_caching=warm)
    try:
        if args.json:
            _print_json(args, pipeline, params, blend, filter)
        else:
            _print_streamed(args, pipeline, params, blend, filter)
    finally:
        pipeline.close()
        pipeline.llm.close()
    return 0


def _check_retrieval_args(args: argparse.Namespace):
    """Check --top-k, --filter and --chunk-order; returns the parsed --filter."""
    from blendkv.rag.chunk_order import check_chunk_order
    from blendkv.rag.filters import parse_filter_args

    if args.top_k < 1:
        raise InvalidRequestError(f"--top-k must be >= 1, got {args.top_k}")
    filter = parse_filter_args(args.filter)
    if args.chunk_order is not None:
        check_chunk_order(args.chunk_order)
    return filter


def _blend_config(args: argparse.Namespace) -> BlendConfig | None:
    """The BlendConfig that --ratio, --fidelity-target and --compare-full ask for."""
    # No --ratio: the engine's default, which its cost check may turn into full prefill when
    # blending would not pay (blend_stats says so). --compare-full compares the blend itself.
    blend = None if args.ratio is None and not args.compare_full else BlendConfig()
    if args.ratio is not None or args.fidelity_target is not None:
        blend = BlendConfig(recompute_ratio=args.ratio, fidelity_target=args.fidelity_target)
    return blend


def _print_json(args, pipeline, params: SamplingParams, blend, filter) -> None:
    """The answer, and what --show-prompt and --compare-full add, as one JSON object."""
    answer = pipeline.query(
        args.question,
        args.top_k,
        params,
        blend,
        args.system,
        filter=filter,
        chunk_order=args.chunk_order,
        verify=args.verify,
    )
    record = answer.to_dict()
    record.update(_explain(args, pipeline, answer, blend, as_json=True))
    print(json.dumps(record))


def _print_streamed(args, pipeline, params: SamplingParams, blend, filter) -> None:
    """The answer as it is generated, then its sources and what --verify, --show-prompt and
    --compare-full add."""
    pieces = pipeline.stream_query(
        args.question,
        args.top_k,
        params,
        blend,
        args.system,
        filter=filter,
        chunk_order=args.chunk_order,
    )
    answer = _write_stream(pieces)
    print("\n")
    print_sources(answer)
    if args.verify:
        print()
        print(_verified(pipeline, answer, blend, args.max_tokens).describe())
    for text in _explain(args, pipeline, answer, blend, as_json=False).values():
        print()
        print(text)


def _write_stream(pieces):
    """Write the text pieces to stdout as they come; returns the RAGAnswer that ends them."""
    from blendkv.rag import RAGAnswer

    answer = None
    for piece in pieces:
        if isinstance(piece, RAGAnswer):
            answer = piece
        else:
            sys.stdout.write(piece)
            sys.stdout.flush()
    return answer


def _verified(pipeline, answer, blend, max_tokens: int):
    """The streamed answer checked against full prefill (:mod:`blendkv.guards.verify`)."""
    from blendkv.guards.verify import verify

    out = pipeline.llm.generate([answer.prompt], SamplingParams(max_tokens=1), blend=blend)[0]
    verification = verify(pipeline.llm, answer.prompt, out, blend, max_tokens)
    answer.blend_stats.verification = verification
    return verification


def _explain(args, pipeline, answer, blend, *, as_json: bool) -> dict:
    """``{"prompt": ..., "compare_full": ...}`` as asked for: JSON values or printable text."""
    from blendkv.rag.explain import compare_full, format_prompt, prompt_segments

    out = {}
    if args.show_prompt:
        segments = prompt_segments(pipeline, answer.prompt, answer.sources)
        out["prompt"] = (
            {"num_tokens": segments[-1].end, "segments": [s.to_dict() for s in segments]}
            if as_json
            else format_prompt(segments)
        )
    if args.compare_full:
        comparison = compare_full(pipeline, answer.prompt, blend, args.max_tokens)
        out["compare_full"] = comparison.to_dict() if as_json else comparison.format()
    return out


def print_sources(answer) -> None:
    print("sources (in prompt order):")
    for i, s in enumerate(answer.sources, 1):
        snippet = " ".join(s.text.split())[:70]
        print(
            f"  [{i}] {s.label} (chunk {s.chunk_id}, #{s.position}) score={s.score:.3f} "
            f"kv_cached={s.kv_cached}  {snippet}"
        )
    st = answer.blend_stats
    ttft = f"{answer.ttft * 1000:.0f} ms" if answer.ttft is not None else "n/a"
    on_device = f" ({st.chunks_on_device} in device memory)" if st.chunks_on_device else ""
    print(
        f"blend: {st.chunks_hit}/{st.num_chunks} chunks hit{on_device}, {st.chunks_missed} missed, "
        f"{st.kv_bytes_loaded / 2**20:.1f} MiB loaded in {st.load_seconds * 1000:.0f} ms; "
        f"TTFT {ttft}"
    )
    print(f"       {st.describe()} ({st.recompute_fraction:.0%} of the reused repaired)")
    if st.cost_choice and st.cost_choice != "blend":
        print(f"       cost check: {st.cost_choice.replace('_', ' ')} ({st.cost_reason})")
