"""``blendkv demo``: ingest the bundled demo documents into a temporary store and answer three
questions, timing full prefill against blended prefill over exactly the same prompt tokens and
printing both answers where they differ (a 135M model answers some questions badly either way).
Per question it says the fidelity target (``--fidelity-target``), the recompute ratio that ran
and whether the blended answer is full prefill's.

Runs in float32 by default: on CPUs without bf16 matrix units, bfloat16 matmuls are several
times slower, and the demo should take well under a minute.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.cli import add_device_args

QUESTIONS = (
    "Which planet is the largest in the Solar System?",
    "Who created the Python programming language?",
    "What dance do worker bees use to show where flowers are?",
)


def demo_docs_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "rag" / "demo_docs"


def register(sub) -> None:
    p = sub.add_parser("demo", help="ingest bundled docs, ask 3 questions, compare TTFT")
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    knob = p.add_mutually_exclusive_group()
    knob.add_argument("--ratio", type=float, default=None, help="default: BlendConfig's")
    knob.add_argument(
        "--fidelity-target",
        type=float,
        default=None,
        metavar="NATS",
        help="let the engine pick the ratio for this target (the demo's store is not "
        "calibrated: the conservative ratio runs)",
    )
    add_device_args(p, dtype="float32")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blendkv import LLM
    from blendkv.rag import RAGPipeline

    blend = BlendConfig(recompute_ratio=args.ratio, fidelity_target=args.fidelity_target)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    print(f"loading the embedded model ({args.dtype}) ...")
    llm = LLM(
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        enable_prefix_caching=False,
    )
    with tempfile.TemporaryDirectory(prefix="blendkv-demo-") as tmp:
        with RAGPipeline(Path(tmp) / "store", llm=llm, chunk_tokens=128) as rag:
            report = rag.ingest([demo_docs_dir()])
            print(report.summary())
            llm.generate(["warm up"], first_token)  # first-call overheads out of the timings
            rows = []
            for q in QUESTIONS:
                sources = rag.order_sources(rag.retrieve(q, args.top_k))  # as query does
                prompt = rag.blended_prompt(q, sources)
                ids = rag.manager.prepare(prompt, blend).prompt.token_ids
                [full] = llm.generate([ids], params)  # the same tokens, nothing reused
                cold = rag.query(q, args.top_k, first_token, blend)  # first read: + checksums
                warm = rag.query(q, args.top_k, params, blend)  # warm: page cache / memory tier
                rows.append((q, len(ids), full, cold.ttft, warm))
            _print(rows, blend)
    llm.close()
    return 0


def _print(rows, blend: BlendConfig) -> None:
    for q, n, full, _, warm in rows:
        st = warm.blend_stats
        reference = full.outputs[0].text.strip()
        same = reference == warm.answer
        print(f"\nQ: {q}\nA, blended: {warm.answer}")
        if not same:
            print(f"A, full prefill: {reference}")
        print(f"   {_knobs(st, blend)}; the same answer as full prefill: {'yes' if same else 'no'}")
        for s in warm.sources:
            print(
                f"   source chunk {s.chunk_id} (score {s.score:.2f}): "
                f"{' '.join(s.text.split())[:60]}..."
            )
        assert st.num_prompt_tokens == n, (st.num_prompt_tokens, n)  # the prompt full prefill ran
        print(f"   {st.chunks_hit}/{st.num_chunks} chunks hit; {st.describe()}")
    print("\nTTFT (ms)                 full prefill   blend (LMDB)   blend (warm)   speed-up")
    for q, _, full, cold, warm in rows:
        full = full.metrics.ttft
        print(
            f"{q[:24]:24s}  {full * 1e3:12.0f}   {cold * 1e3:12.0f}   {warm.ttft * 1e3:12.0f}"
            f"   {full / warm.ttft:7.1f}x"
        )


def _knobs(stats, blend: BlendConfig) -> str:
    """The target asked for (if any) and the recompute ratio the blend ran at."""
    ratio = stats.chosen_recompute_ratio  # the engine's pick for a target
    if ratio is None:
        return f"recompute ratio {blend.recompute_ratio:g}"
    calibrated = "calibrated" if stats.calibrated else "no calibration"
    target = stats.fidelity_target
    return f"fidelity target {target:g} nats: recompute ratio {ratio:g} ({calibrated})"
