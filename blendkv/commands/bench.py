"""``blendkv bench engine|store``: benchmarks (correctness checked first, ratios side by side)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark")
    bench = p.add_subparsers(dest="bench", required=True)
    e = bench.add_parser("engine", help="batched throughput and prefill vs transformers")
    e.add_argument("--model", default=None)
    e.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    e.add_argument("--num-requests", type=int, default=32)
    e.add_argument("--output-tokens", type=int, default=64)
    e.add_argument("--prefill-tokens", type=int, default=2048)
    e.add_argument("--repeats", type=int, default=3, help="prefill timings (best of N)")
    e.add_argument("--json", default=None, help="also write the results to this file")
    e.set_defaults(func=_engine)
    b = bench.add_parser("blend", help="TTFT of full prefill vs blend vs reuse on MuSiQue")
    b.add_argument("--model", default=None)
    b.add_argument("--data", default=None, help="CacheBlend-format JSON (default: MuSiQue dev)")
    b.add_argument("--limit", type=int, default=5)
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    b.add_argument("--ratio", type=float, default=0.15)
    b.add_argument("--json", default=None)
    b.set_defaults(func=_blend)


def _engine(args: argparse.Namespace) -> int:
    from blendkv.eval.bench_engine import main

    return main(args)


def _blend(args: argparse.Namespace) -> int:
    from blendkv.eval.bench_blend import main

    return main(args)
