"""``blendkv bench engine|decode|threads|sampler|blend|gpu|gemm|attention|gpu-attention|
launches|compile|prefetch|store|replicas|route-sim``: benchmarks, correctness first, ratios
side by side.

The CLI finds this command through the ``blendkv.commands`` entry-point group (pyproject.toml),
so the engine never imports the harness. Each kind's module is imported only when it runs
(``launches`` sets ``TRITON_INTERPRET`` on import; the others import torch).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from blendkv.commands.config_args import add_config_args
from blendkv.config import EngineConfig
from blendkv.connector.config import BlendConnectorConfig


def register_bench(sub) -> None:
    """Add the ``bench`` command and its kinds to the CLI's subparsers ``sub``."""
    p = sub.add_parser("bench", help="run a benchmark")
    bench = p.add_subparsers(dest="bench", required=True)
    _add_engine(bench)
    _add_deterministic(bench)
    _add_threads(bench)
    _add_decode(bench)
    _add_sampler(bench)
    _add_blend(bench)
    _add_gpu(bench)
    _add_gemm(bench)
    _add_attention(bench)
    _add_gpu_attention(bench)
    _add_launches(bench)
    _add_compile(bench)
    _add_prefetch(bench)
    _add_store(bench)
    _add_stall(bench)
    _add_plot(bench)
    _add_replicas(bench)
    _add_route_sim(bench)


def _add_engine(bench) -> None:
    p = bench.add_parser("engine", help="batched throughput and prefill vs transformers")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="prefill timings (best of N)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=_run("engine"))


def _add_deterministic(bench) -> None:
    p = bench.add_parser("deterministic", help="the cost of --deterministic: decode, prefill")
    add_config_args(p, EngineConfig, ("model", "dtype"), defaults={"dtype": "bfloat16"})
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timings (best of N, interleaved)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=_run("deterministic"))


def _add_threads(bench) -> None:
    p = bench.add_parser(
        "threads",
        help="CPU prefill and decode per OpenMP wait setting, alone and beside a busy process",
    )
    add_config_args(p, EngineConfig, ("model", "dtype"))
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every setting and load")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=_run("threads"))


def _add_decode(bench) -> None:
    p = bench.add_parser("decode", help="batched decode vs transformers and llama.cpp (one stream)")
    add_config_args(p, EngineConfig, ("model", "dtype"), defaults={"dtype": "float32"})
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument(
        "--llama-requests",
        type=int,
        default=4,
        help="prompts run through llama.cpp, one stream each (0: skip llama.cpp)",
    )
    add_config_args(p, EngineConfig, ("attention_backend", "cpu_gemm"))
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run("decode"))


def _add_sampler(bench) -> None:
    p = bench.add_parser("sampler", help="a sampler step with penalties vs plain greedy")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--num-threads", type=int, default=None)
    p.set_defaults(func=_run("sampler"))


def _add_blend(bench) -> None:
    p = bench.add_parser("blend", help="TTFT of full prefill vs blend vs reuse on MuSiQue")
    add_config_args(p, EngineConfig, ("model",))
    p.add_argument("--data", default=None, help="CacheBlend-format JSON (default: MuSiQue dev)")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument(
        "--repeats", type=int, default=1, help="TTFTs per method and example, interleaved: median"
    )
    add_config_args(p, EngineConfig, ("dtype",), defaults={"dtype": "bfloat16"})
    p.add_argument("--ratio", type=float, default=None, help="default: BlendConfig's")
    p.add_argument("--selection", default=None, help="default: BlendConfig's")
    p.add_argument(
        "--profile", action="store_true", help="per request: where the time goes, the floor"
    )
    add_config_args(
        p,
        BlendConnectorConfig,
        ("pipeline_kv_load",),
        aliases={"pipeline_kv_load": ("--pipeline",)},
    )
    add_config_args(p, EngineConfig, ("attention_backend", "prune_last_layer"))
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run("blend"))


def _add_gpu(bench) -> None:
    p = bench.add_parser(
        "gpu", help="random-weight real shapes: prefill, blend and decode vs transformers"
    )
    p.add_argument("--shapes", default="llama8b,qwen05", help="llama8b, qwen05, tiny")
    add_config_args(
        p, EngineConfig, ("device", "attention_backend", "dtype"), defaults={"dtype": "bfloat16"}
    )
    p.add_argument("--prefill-tokens", type=int, default=6144)
    p.add_argument(
        "--blend-prompts",
        default="3000:10,6144:10,16384:24",
        help="blended prompt sizes, TOKENS:DOCS,... ('' skips the blend part)",
    )
    p.add_argument(
        "--ratio", type=float, default=0.15, help="CacheBlend's V-deviation pick at this ratio"
    )
    p.add_argument("--decode-tokens", type=int, default=64, help="0 skips the decode part")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="blend TTFTs: median of N")
    p.add_argument("--kv-cache-gb", type=int, default=8)
    p.add_argument("--kv-store-gb", type=int, default=8, help="the chunk store's memory tier")
    p.add_argument(
        "--device-tier-gb",
        type=int,
        default=4,
        help="the device-tier variant's kv_device_cache_bytes (blend and reuse with the chunks "
        "kept in device memory); 0 skips it",
    )
    p.add_argument(
        "--variants",
        default="serial-load,device-tier,unsplit,untuned,eager",
        help="engine settings also timed, each in an engine of its own ('' for none): "
        "serial-load, device-tier, unsplit, untuned (Triton), eager (CUDA graphs)",
    )
    p.add_argument("--json", default=None)
    p.add_argument(
        "--profile", default=None, metavar="DIR", help="write host/device profiles of the requests"
    )
    p.set_defaults(func=_run("gpu"))


def _add_gemm(bench) -> None:
    p = bench.add_parser("gemm", help="CPU GEMM libraries at a model's shapes (cpu_gemm)")
    add_config_args(p, EngineConfig, ("model",))
    p.add_argument("--rows", default="1,32,2048")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run("gemm"))


def _add_attention(bench) -> None:
    p = bench.add_parser(
        "attention", help="CPU attention: the torch reference, removed eager paths, C++ kernels"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.set_defaults(func=_run("cpu_attention"))


def _add_gpu_attention(bench) -> None:
    p = bench.add_parser(
        "gpu-attention", help="Triton prefill attention with and without key splits (device ms)"
    )
    add_config_args(p, EngineConfig, ("device",))
    p.add_argument("--heads", default="32:8:128,14:2:64", help="HEADS:KV_HEADS:HEAD_DIM,...")
    p.add_argument("--rows", default="30,450", help="query rows of the sequence")
    p.add_argument("--keys", default="3000,6144,16384", help="keys the rows follow (and are)")
    p.add_argument("--repeats", type=int, default=20, help="--tune: ms of timed calls per case")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--tune", action="store_true", help="time a grid of tile configs; pick this GPU's best"
    )
    p.add_argument(
        "--configs", default=None, help="--tune: BLOCK_M:BLOCK_N:WARPS:STAGES,... (default: grid)"
    )
    p.add_argument("--tune-out", default=None, help="--tune: merge the winners into this table")
    p.set_defaults(func=_run("gpu_attention"))


def _add_launches(bench) -> None:
    p = bench.add_parser(
        "launches", help="device kernels a blended request launches, counted without a GPU"
    )
    p.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-3.1-8B: 32)")
    p.add_argument("--docs", type=int, default=10)
    p.add_argument("--doc-words", type=int, default=24)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument(
        "--eager", action="store_true", help="no piecewise graphs (the engine's on CUDA)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="the engine's (the query pass's graphs run over its key blocks: fewer interpret "
        "faster; the counts are the same)",
    )
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run("launches"))


def _add_compile(bench) -> None:
    p = bench.add_parser(
        "compile", help="the engine's Triton kernels compiled for a GPU generation, without one"
    )
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100)")
    p.add_argument("--shapes", default="tiny,qwen05,llama8b", help="eval.random_model shapes")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--json", default=None, help="write every compiled variant here")
    p.set_defaults(func=_run("compile"))


def _store_arg(text: str) -> str:
    if text not in ("lmdb", "redis") and not text.startswith("redis://"):
        raise argparse.ArgumentTypeError(f"must be lmdb, redis or a redis:// URL, got {text!r}")
    return text


def _add_prefetch(bench) -> None:
    p = bench.add_parser(
        "prefetch", help="queued requests' chunks read ahead of their step vs in it (cold reads)"
    )
    add_config_args(p, EngineConfig, ("model",))
    p.add_argument("--data", default=None, help="CacheBlend-format JSON (default: MuSiQue dev)")
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--store", type=_store_arg, default="lmdb", help="lmdb, redis, or a redis:// URL"
    )
    add_config_args(p, EngineConfig, ("dtype",), defaults={"dtype": "float32"})
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run("prefetch"))


def _backends(text: str) -> list[str]:
    backends = text.split(",")
    if not set(backends) <= {"lmdb", "redis"}:
        raise argparse.ArgumentTypeError(f"takes lmdb, redis or both, got {text!r}")
    return backends


def _add_store(bench) -> None:
    p = bench.add_parser(
        "store", help="chunk store reads, writes, lookups and FAISS search; --backend: scaling"
    )
    p.add_argument("--quick", action="store_true", help="small sizes (~1 minute)")
    p.add_argument("--chunks", type=int, default=None, help="chunks for the read bench")
    p.add_argument("--dir", default=None, help="parent of the temp data dir")
    p.add_argument(
        "--backend",
        type=_backends,
        default=None,
        help="lmdb, redis or lmdb,redis: run the scaling benchmark",
    )
    p.add_argument("--sizes", default="1000,10000,100000", help="store sizes (entries)")
    p.add_argument("--out", default="bench_out/store", help="scaling results folder")
    p.add_argument("--redis-url", default=None, help="default: a private redis-server")
    p.set_defaults(func=_run("store"))


def _add_plot(bench) -> None:
    p = bench.add_parser("plot", help="the benchmarks page's plots, from saved result files")
    p.add_argument(
        "--eval",
        nargs="*",
        default=None,
        metavar="RUN_DIR",
        help="blendkv eval --out folders: answer KL against R and against TTFT",
    )
    p.add_argument(
        "--ttft",
        nargs="*",
        default=None,
        metavar="BENCH_JSON",
        help="blendkv bench gpu --json files: TTFT against prompt length",
    )
    p.add_argument("--out", required=True, help="folder the PNG files go to")
    p.set_defaults(func=_run("plot"))


def _latency(text: str) -> float | None:
    return None if text.strip().lower() == "none" else float(text)


def _add_stall(bench) -> None:
    p = bench.add_parser(
        "stall", help="streaming clients while one big request runs: their gaps and throughput"
    )
    add_config_args(p, EngineConfig, ("model",))
    add_config_args(p, EngineConfig, ("dtype",), defaults={"dtype": "float32"})
    p.add_argument("--clients", type=int, default=4, help="streaming clients")
    p.add_argument(
        "--docs",
        type=int,
        default=700,
        help="new tiny documents in one request (700 make ~7K tokens)",
    )
    p.add_argument("--long-tokens", type=int, default=8191, help="tokens of the long prompt")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the baseline")
    p.add_argument(
        "--max-step-latency", type=_latency, default=0.25, help="seconds a step, or none"
    )
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run("stall"))


def _add_replicas(bench) -> None:
    from blendkv.entrypoints.ray_serve.routing import DEFAULT_IMBALANCE

    from .route_sim import policies_arg

    p = bench.add_parser(
        "replicas",
        help="replicas on a local Ray cluster: chunk-affinity vs round-robin vs least-loaded "
        "routing on a Zipf RAG workload (needs blendkv[ray] and redis-server)",
    )
    add_config_args(p, EngineConfig, ("model",))
    add_config_args(p, EngineConfig, ("dtype",), defaults={"dtype": "float32"})
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", type=policies_arg, default=list(_POLICIES))
    p.add_argument("--imbalance", type=int, default=DEFAULT_IMBALANCE)
    p.add_argument("--documents", type=int, default=48, help="passages in the corpus")
    p.add_argument("--per-request", type=int, default=4, help="documents per request")
    p.add_argument("--topic-size", type=int, default=8, help="documents per topic")
    p.add_argument("--requests", type=int, default=64, help="requests per router")
    p.add_argument("--zipf-s", type=float, default=1.0, help="popularity exponent")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (closed loop)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals at this many requests/s instead of --concurrency",
    )
    p.add_argument("--rounds", type=int, default=1, help="runs of every router, in turn")
    p.add_argument(
        "--memory-tier-chunks", type=int, default=16, help="each replica's memory tier, in chunks"
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-cache-mb", type=int, default=384, help="each replica's KV pool")
    p.add_argument("--kill-replica", action="store_true", help="also kill one mid-stream")
    p.add_argument("--tier-samples", type=int, default=4, help="requests timed per tier")
    p.add_argument("--cpus", type=int, default=2, help="the local Ray cluster's CPUs")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run("replicas"))


_POLICIES = ("round-robin", "least-loaded", "chunk-affinity", "cost-aware")


def _add_route_sim(bench) -> None:
    from blendkv.entrypoints.ray_serve.routing import DEFAULT_IMBALANCE, POLICIES

    from .route_sim import ints_arg, policies_arg

    p = bench.add_parser(
        "route-sim",
        help="the same routers simulated to 64 replicas with measured per-tier costs",
    )
    p.add_argument("--costs", default=None, help="a `bench replicas --json` file")
    p.add_argument("--replicas", type=ints_arg, default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--policies", type=policies_arg, default=list(POLICIES))
    p.add_argument("--imbalance", type=int, default=DEFAULT_IMBALANCE)
    p.add_argument("--documents-per-replica", type=int, default=48)
    p.add_argument("--requests-per-replica", type=int, default=200)
    p.add_argument("--memory-tier-chunks", type=int, default=24)
    p.add_argument("--per-request", type=int, default=4)
    p.add_argument("--topic-size", type=int, default=8, help="documents per topic")
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument(
        "--load",
        type=float,
        default=0.8,
        help="arrivals / capacity with every chunk from the store",
    )
    p.add_argument("--stats-period", type=float, default=1.0, help="seconds between reports")
    p.add_argument("--ingest-workers", type=ints_arg, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run("route_sim"))


def _run(kind: str):
    """The ``func`` of a kind: import ``blendkv.eval.bench.<kind>`` and run its ``main``."""

    def run(args: argparse.Namespace) -> int:
        if getattr(args, "json", None):  # e.g. bench_out/decode.json on a fresh checkout
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        result = importlib.import_module(f"blendkv.eval.bench.{kind}").main(args)
        return result if isinstance(result, int) else 0  # the store bench returns its results

    return run
