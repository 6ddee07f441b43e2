"""The ``blendkv`` command line; each subcommand lives in ``blendkv.commands.<name>``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from blendkv.commands.config_args import add_config_args, config_kwargs
from blendkv.config import CacheConfig, EngineConfig, GuardConfig, SchedulerConfig
from blendkv.connector.config import BlendConnectorConfig
from blendkv.errors import BlendKVError

_COMMANDS = ("generate", "chat", "ingest", "ask", "docs", "store", "calibrate", "demo", "serve")
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


# The config fields every model-loading command takes as flags (flags generated from the
# dataclasses by blendkv.commands.config_args; help text from their docstrings).
ENGINE_FLAGS = (
    "model",
    "dtype",
    "max_model_len",
    "num_kv_blocks",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "block_size",
    "num_threads",
    "enforce_eager",
    "max_graph_rows",
    "prune_last_layer",
    "deterministic",
    "device",
    "attention_backend",
    "cpu_gemm",
    "max_step_latency",
)
GUARD_FLAGS = ("blend_start_gate", "blend_cost_check")
# EngineConfig and the configs nested in it: their fields are the engine's flat options.
ENGINE_CONFIGS = (EngineConfig, CacheConfig, SchedulerConfig, GuardConfig)
CONNECTOR_FLAGS = (
    "kv_store_memory_bytes",
    "kv_device_cache_bytes",
    "kv_codec",
    "pipeline_kv_load",
    "prefetch_kv",
    "prefetch_kv_bytes",
)
DEVICE_FLAGS = ("device", "attention_backend")
# Older flag names that keep working beside the generated ones.
FLAG_ALIASES = {"enable_prefix_caching": ("--prefix-caching",)}


def add_model_args(p: argparse.ArgumentParser, engine_fields: tuple[str, ...] = ()) -> None:
    """Engine and blend connector options shared by every command that loads a model, plus
    the command's own ``engine_fields``."""
    engine = p.add_argument_group("engine (EngineConfig, CacheConfig, SchedulerConfig)")
    add_config_args(engine, ENGINE_CONFIGS, ENGINE_FLAGS + engine_fields, aliases=FLAG_ALIASES)
    engine.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run one short request at load, so the first request's TTFT is its own "
        "(default: %(default)s)",
    )
    guards = p.add_argument_group("guards (GuardConfig)")
    add_config_args(guards, GuardConfig, GUARD_FLAGS)
    connector = p.add_argument_group("blend connector (BlendConnectorConfig)")
    add_config_args(connector, BlendConnectorConfig, CONNECTOR_FLAGS)
    p.set_defaults(engine_fields=engine_fields)


def add_device_args(p: argparse.ArgumentParser, **defaults) -> None:
    """``--device`` and ``--attention-backend`` (and ``--dtype`` when a default is given)."""
    names = (("dtype",) if "dtype" in defaults else ()) + DEVICE_FLAGS
    add_config_args(p, EngineConfig, names, defaults=defaults)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The parsed engine, guard and connector options (all but ``model``) and ``warmup``, as
    ``LLM`` keywords."""
    names = ENGINE_FLAGS + getattr(args, "engine_fields", ()) + GUARD_FLAGS + CONNECTOR_FLAGS
    names = [n for n in names if n != "model"]
    return {**config_kwargs(args, names), "warmup": args.warmup}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that left shows here, not in Python's flush at exit
        return code
    except BlendKVError as exc:
        print(f"blendkv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `blendkv store stats | head -1`: the reader left. Point stdout at /dev/null so that
        # Python's flush at exit does not fail again, and exit quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
