"""``blendkv bench engine|decode|blend|gpu``: benchmarks, correctness first, ratios side by side."""

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
    d = bench.add_parser("decode", help="batched decode vs transformers and llama.cpp (one stream)")
    d.add_argument("--model", default=None)
    d.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    d.add_argument("--num-requests", type=int, default=32)
    d.add_argument("--output-tokens", type=int, default=64)
    d.add_argument(
        "--llama-requests",
        type=int,
        default=4,
        help="prompts run through llama.cpp, one stream each (0: skip llama.cpp)",
    )
    d.add_argument("--cpu-gemm", default="auto", choices=["auto", "onednn", "mkl"])
    d.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="EngineConfig.compile_decode (CPU; default: on where it applies)",
    )
    d.add_argument("--json", default=None)
    d.set_defaults(func=_decode)
    b = bench.add_parser("blend", help="TTFT of full prefill vs blend vs reuse on MuSiQue")
    b.add_argument("--model", default=None)
    b.add_argument("--data", default=None, help="CacheBlend-format JSON (default: MuSiQue dev)")
    b.add_argument("--limit", type=int, default=5)
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    b.add_argument("--ratio", type=float, default=None, help="default: BlendConfig's")
    b.add_argument("--selection", default=None, help="default: BlendConfig's")
    b.add_argument(
        "--profile", action="store_true", help="per request: where the time goes, the floor"
    )
    b.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write loaded K/V layer by layer behind the forward (--no-pipeline: before it; "
        "default: EngineConfig's per-device choice)",
    )
    b.add_argument(
        "--compile-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="EngineConfig.compile_prefill (CPU; default: on where it applies)",
    )
    b.add_argument(
        "--prune-last-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="EngineConfig.prune_last_layer (default: on)",
    )
    b.add_argument("--json", default=None)
    b.set_defaults(func=_blend)
    g = bench.add_parser(
        "gpu", help="random-weight real shapes: prefill, blend and decode vs transformers"
    )
    g.add_argument("--shapes", default="llama8b,qwen05", help="llama8b, qwen05, tiny")
    g.add_argument("--device", default="auto")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--prefill-tokens", type=int, default=6144)
    g.add_argument("--docs", type=int, default=10, help="documents in the blended prompt")
    g.add_argument("--doc-tokens", type=int, default=600, help="about this many tokens each")
    g.add_argument("--ratio", type=float, default=0.15)
    g.add_argument("--decode-tokens", type=int, default=64)
    g.add_argument("--concurrency", type=int, default=32)
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--kv-cache-gb", type=int, default=8)
    g.add_argument("--json", default=None)
    g.add_argument(
        "--profile", default=None, metavar="DIR", help="write host/device profiles of the requests"
    )
    g.set_defaults(func=_gpu)


def _engine(args: argparse.Namespace) -> int:
    from blendkv.eval.bench_engine import main

    return main(args)


def _decode(args: argparse.Namespace) -> int:
    from blendkv.eval.bench_decode import main

    return main(args)


def _gpu(args: argparse.Namespace) -> int:
    from blendkv.eval.bench_gpu import main

    return main(args)


def _blend(args: argparse.Namespace) -> int:
    from blendkv.eval.bench_blend import main

    return main(args)
