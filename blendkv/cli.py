"""The ``blendkv`` command line; each subcommand lives in ``blendkv.commands.<name>``."""

from __future__ import annotations

import argparse
import logging
import sys

from blendkv.errors import BlendKVError

_COMMANDS = ("generate", "chat", "ingest", "ask", "store", "demo", "serve")
# Commands of other packages (``eval``, ``bench``: blendkv.eval), found by entry point so that
# blendkv never imports them: ``[project.entry-points."blendkv.commands"]`` in pyproject.toml.
_ENTRY_POINT_GROUP = "blendkv.commands"


def build_parser() -> argparse.ArgumentParser:
    import importlib
    from importlib.metadata import entry_points

    parser = argparse.ArgumentParser(
        prog="blendkv", description="RAG serving engine that reuses document K/V caches"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"blendkv.commands.{name}").register(sub)
    for entry_point in sorted(entry_points(group=_ENTRY_POINT_GROUP), key=lambda e: e.name):
        entry_point.load()(sub)
    return parser


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that loads a model."""
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: embedded)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: the faster on the device (float32 on CPUs without native bf16)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--cpu-gemm",
        default="auto",
        choices=["auto", "onednn", "mkl"],
        help="CPU GEMM library (auto: oneDNN except on Intel CPUs)",
    )
    p.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU, float32/bfloat16: decode attention through one C++ kernel call per layer "
        "(default: on where it applies; built on the first start, ~10 s, then cached)",
    )
    p.add_argument(
        "--compile-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU, float32/bfloat16: prefill attention through one C++ kernel call per "
        "sequence and layer (default: on where it applies)",
    )
    p.add_argument(
        "--prune-last-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="attention and MLP of the last layer only for the rows a step reads",
    )
    p.add_argument(
        "--prefetch-kv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read queued blended requests' chunks ahead of their step (default: on with CUDA "
        "and for LMDB; a Redis store on the CPU only with a core torch leaves free)",
    )
    p.add_argument(
        "--prefetch-kv-bytes",
        type=int,
        default=1 << 30,
        help="the most prefetched K/V held in memory at once (Redis; LMDB on CUDA; 1 GiB)",
    )
    add_device_args(p)


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="auto: triton on CUDA, torch on the CPU",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "num_kv_blocks": args.num_kv_blocks,
        "block_size": args.block_size,
        "device": args.device,
        "attention_backend": args.attention_backend,
        "cpu_gemm": args.cpu_gemm,
        "compile_decode": args.compile_decode,
        "compile_prefill": args.compile_prefill,
        "prune_last_layer": args.prune_last_layer,
        "prefetch_kv": args.prefetch_kv,
        "prefetch_kv_bytes": args.prefetch_kv_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except BlendKVError as exc:
        print(f"blendkv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
