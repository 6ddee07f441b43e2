"""``blendkv serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os

from blendkv.cli import add_model_args, engine_kwargs
from blendkv.commands.ingest import add_store_max_bytes_arg
from blendkv.config import resolve_device
from blendkv.engine_args import create_engine_config, follow_store_dtype
from blendkv.entrypoints.openai.serve_config import ServeConfig
from blendkv.errors import BlendKVError, ConfigError
from blendkv.guards.audit import DEFAULT_WARN_KL, WARN_WINDOW
from blendkv.sizes import size_arg

logger = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with document blending")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    _add_store_args(p)
    _add_client_args(p)
    _add_limit_args(p)
    p.add_argument(
        "--blend-audit-warn-kl",
        type=float,
        default=DEFAULT_WARN_KL,
        metavar="NATS",
        help="with --blend-audit-rate, warn when the mean first-token KL(full || blend) of the "
        f"last {WARN_WINDOW} audited requests passes it (default {DEFAULT_WARN_KL})",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_replica_args(p)
    add_model_args(
        p,
        (
            "max_num_seqs",
            "max_num_batched_tokens",
            "enable_prefix_caching",
            "blend_audit_rate",
        ),
    )
    p.set_defaults(func=run)


def _add_store_args(p: argparse.ArgumentParser) -> None:
    """Where the chunk K/V lives: --store, its bound, and the cache of documents sent in
    requests."""
    p.add_argument("--store", default=None, metavar="DIR", help="chunk store for `rag` requests")
    add_store_max_bytes_arg(p)
    p.add_argument(
        "--request-cache-bytes",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="bound on disk of the cache of documents sent in requests (its LMDB file stays "
        "within it, 1M at least; their K/V never goes into --store), e.g. 500M (default: "
        "min(2G, 10%% of the free temporary disk))",
    )


def _add_client_args(p: argparse.ArgumentParser) -> None:
    """What clients send: the API key and the model id."""
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $BLENDKV_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None, help="model id clients send")


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """Bounds on what the server accepts: queued requests, body size, documents per
    request, and how long a shutdown waits."""
    p.add_argument(
        "--max-waiting", type=int, default=256, help="queued requests before 429 (default 256)"
    )
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/Ctrl-C, how long in-flight requests may finish (new ones and /health "
        "get 503) before the rest are aborted (default 30)",
    )
    p.add_argument(
        "--max-request-documents",
        type=int,
        default=None,
        metavar="N",
        help="most documents one chat request may carry (default 1024)",
    )
    p.add_argument(
        "--max-document-tokens",
        type=int,
        default=None,
        metavar="N",
        help="most tokens the documents of one request may take in all (default max_model_len)",
    )


def add_replica_args(p: argparse.ArgumentParser) -> None:
    from blendkv.entrypoints.ray_serve.routing import DEFAULT_IMBALANCE, POLICIES

    ray = p.add_argument_group("replicas on Ray Serve (pip install 'blendkv[ray]')")
    ray.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="run N engine replicas on Ray Serve behind this endpoint, sharing --store "
        "redis://... (default: one engine in this process)",
    )
    ray.add_argument(
        "--router",
        default="cost-aware",
        choices=POLICIES,
        help="how a request picks its replica: the least expected wait, queue x service time "
        "+ chunks not held x store-load seconds, as the replicas measured them (cost-aware); "
        "the one whose memory and device tiers hold most of its chunks (chunk-affinity, "
        "bounded by --imbalance); round-robin; or least-loaded (default: %(default)s)",
    )
    ray.add_argument(
        "--imbalance",
        type=int,
        default=DEFAULT_IMBALANCE,
        metavar="REQUESTS",
        help="chunk-affinity (and cost-aware until the replicas measured their costs): how "
        "many more requests than the least loaded replica the replica holding the chunks may "
        "hold (default: %(default)s)",
    )
    ray.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to run on ('auto': the one running here; default: start a local one)",
    )
    ray.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs each replica takes (default 1)"
    )
    ray.add_argument(
        "--replica-gpus", type=float, default=0.0, help="GPUs each replica takes (default 0)"
    )


def run(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return _run_replicas(args)
    try:
        import uvicorn

        from blendkv.entrypoints.openai.api_server import ServeConfig, create_app
        from blendkv.entrypoints.openai.shutdown import DrainingServer
    except ImportError as exc:
        raise ConfigError(
            f"blendkv serve needs the serve extra ({exc}); pip install 'blendkv[serve]'"
        ) from exc
    # dtype auto follows the store's (engine_args.follow_store_dtype).
    kwargs = follow_store_dtype(engine_kwargs(args), args.store)
    # Bad options (and a GPU that is not there) fail here, before the server starts.
    create_engine_config(model=args.model, **{k: v for k, v in kwargs.items() if k != "warmup"})
    resolve_device(args.device)
    try:
        config = ServeConfig(
            api_key=args.api_key or os.environ.get("BLENDKV_API_KEY") or None,
            served_model_name=args.served_model_name,
            store_dir=args.store,
            store_max_bytes=args.store_max_bytes,
            request_cache_bytes=args.request_cache_bytes,
            max_waiting=args.max_waiting,
            max_body_bytes=args.max_body_bytes,
            max_request_documents=args.max_request_documents,
            max_document_tokens=args.max_document_tokens,
            shutdown_timeout=args.shutdown_timeout,
            blend_audit_warn_kl=args.blend_audit_warn_kl,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if config.api_key is None and not _is_loopback(args.host):
        logger.warning("serving on %s without --api-key: anyone reaching it can use it", args.host)

    def load():
        from blendkv import LLM

        return LLM(args.model, **kwargs)

    app = create_app(load, config)
    state = app.state.blendkv
    server = DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level),
        state,
        config.shutdown_timeout,
    )

    def stop(exc: BaseException) -> None:
        server.should_exit = True

    state.on_load_error = stop
    server.run()
    if state.load_error is not None:
        if isinstance(state.load_error, BlendKVError):
            raise state.load_error
        return 1
    return 0


def _run_replicas(args: argparse.Namespace) -> int:
    """``--replicas N``: the same server, N engines on Ray Serve (docs/guide/ray.md)."""
    from blendkv.rag.distributed import RAY_MISSING
    from blendkv.store.redis_store import is_redis_url

    if args.replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, got {args.replicas}")
    if args.store is not None and not is_redis_url(args.store):
        raise ConfigError(
            "replicas share one store: give --store redis://HOST:PORT/DB (an LMDB store has "
            "one writer)"
        )
    try:
        from blendkv.entrypoints.ray_serve.app import build_app, serve_replicas
    except ImportError as exc:
        raise ConfigError(f"--replicas {RAY_MISSING} ({exc})") from exc
    options = follow_store_dtype(engine_kwargs(args), args.store)
    create_engine_config(model=args.model, **{k: v for k, v in options.items() if k != "warmup"})
    if args.replica_gpus == 0 and options.get("num_threads") is None:
        options["num_threads"] = max(1, int(args.replica_cpus))
    serve_options = dict(
        api_key=args.api_key or os.environ.get("BLENDKV_API_KEY") or None,
        served_model_name=args.served_model_name,
        store_dir=args.store,
        request_cache_bytes=args.request_cache_bytes,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        max_request_documents=args.max_request_documents,
        max_document_tokens=args.max_document_tokens,
        blend_audit_warn_kl=args.blend_audit_warn_kl,
    )
    try:
        ServeConfig(**serve_options)  # bad options fail here, before Ray starts
        app = build_app(
            args.model,
            replicas=args.replicas,
            policy=args.router,
            imbalance=args.imbalance,
            engine_options=options,
            serve_options=serve_options,
            replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    url = f"http://{args.host}:{args.port}"

    def ready() -> None:
        print(f"serving {args.replicas} replicas ({args.router}) on {url}", flush=True)

    serve_replicas(
        app, host=args.host, port=args.port, ray_address=args.ray_address, on_ready=ready
    )
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
