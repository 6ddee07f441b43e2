"""``blendkv serve --replicas N``: N engine replicas on Ray Serve behind one OpenAI endpoint.

    client ──HTTP──▶ Ray Serve proxy ──▶ BlendKVIngress (no model: a tokenizer, and with a
                                         store the retriever) ── request's chunks ─┐
                                                                                    ▼
                        BlendKVRouter (the policy, on the replicas' tier summaries and queues)
                                                                                    │
                         BlendKVReplica × N  ◀─────────────────────────────────────┘
                         (engine + blendkv's own OpenAI app; reports its tier summary)

The ingress reads the body (documents, or ``rag``: it retrieves), maps it to the request's
chunks (:mod:`.keys`) and hands the request on through a deployment handle; Ray Serve's router
for the replica deployment is :class:`~.router.BlendKVRouter`. The response streams back piece
by piece. A replica that dies mid-response ends its stream with an error event (``data:
{"error": ...}`` then ``data: [DONE]``), never a hang; Ray Serve starts a replacement and the
others keep serving. A replica that dies before answering gets a 503.

:func:`build_app` makes the application (``serve.run`` it on any Ray cluster);
:func:`app_builder` is the same for ``serve run blendkv.entrypoints.ray_serve.app:app_builder
key=value ...`` and Serve config files; :func:`serve_replicas` is the command.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route's annotations
# (``request: Request``) at run time, and under Serve's class ingress it cannot resolve strings.

import asyncio
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from blendkv.entrypoints.openai.errors import APIError
from blendkv.entrypoints.ray_serve.replica import BlendKVReplica, ForwardedRequest, ResponseStart
from blendkv.entrypoints.ray_serve.router import BlendKVRouter
from blendkv.entrypoints.ray_serve.routing import DEFAULT_IMBALANCE, POLICIES

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 1.0  # how often a replica reports its tier summary
ingress_api = FastAPI(title="blendkv replicas", docs_url=None, redoc_url=None)
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


# Defined before the ingress class: ``serve.ingress`` pickles the routes when it decorates it,
# with the module's names defined so far.
async def _pieces(stream, start: ResponseStart) -> AsyncIterator[bytes]:
    """The response body as the replica sends it; a replica lost mid-response ends an event
    stream with an error event (and ``[DONE]``), and cuts any other body short."""
    events = any(
        k.lower() == b"content-type" and v.startswith(b"text/event-stream")
        for k, v in start.headers
    )
    ended = False
    try:
        async for piece in stream:
            yield piece
        ended = True
    except Exception as exc:
        logger.warning("a replica was lost mid-response: %s", exc)
        if events:
            yield f"data: {json.dumps(_replica_lost(exc).body())}\n\n".encode()
            yield b"data: [DONE]\n\n"
    finally:
        if not ended:
            stream.cancel()  # the client left, or the replica is gone: stop its request


def _replica_lost(exc: BaseException) -> APIError:
    return APIError(
        503,
        f"the replica serving this request was lost ({type(exc).__name__}); retry it",
        "server_error",
        code="replica_lost",
    )


@serve.deployment(name="BlendKVIngress", ray_actor_options={"num_cpus": 0})
@serve.ingress(ingress_api)
class BlendKVIngress:
    """Reads each request's chunks and hands it to a replica (see the module docstring)."""

    def __init__(self, replicas, store_dir: str | None = None) -> None:
        self.replicas = replicas
        self.store_dir = store_dir
        self._chunks = None  # RequestChunks, made once a replica gave its key recipe
        self._lock = asyncio.Lock()

    async def request_chunks(self):
        async with self._lock:
            if self._chunks is None:
                from blendkv.entrypoints.ray_serve.keys import RequestChunks

                recipe = await self.replicas.key_recipe.remote()
                self._chunks = await asyncio.to_thread(RequestChunks, recipe, self.store_dir)
        return self._chunks

    @ingress_api.api_route("/{path:path}", methods=_METHODS)
    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        keys = await self.request_chunks()
        chunks = await asyncio.to_thread(keys.of, request.method, request.url.path, body)
        forwarded = ForwardedRequest(
            request.method,
            request.url.path,
            request.url.query.encode(),
            tuple(request.headers.raw),
            body,
            tuple(tuple(c) for c in chunks),
        )
        stream = self.replicas.options(stream=True).forward.remote(forwarded)
        try:
            start = await stream.__anext__()
        except Exception as exc:  # the replica died (or failed) before answering
            logger.warning("a replica failed before answering: %s", exc)
            return _replica_lost(exc).response()
        assert isinstance(start, ResponseStart), start
        response = StreamingResponse(_pieces(stream, start), status_code=start.status)
        # The body may end early (a replica lost mid-response): no content-length.
        response.raw_headers = [(k, v) for k, v in start.headers if k.lower() != b"content-length"]
        return response


def build_app(
    model: str | None = None,
    *,
    replicas: int = 2,
    policy: str = "cost-aware",
    imbalance: int = DEFAULT_IMBALANCE,
    engine_options: dict | None = None,
    serve_options: dict | None = None,
    replica_cpus: float = 1.0,
    replica_gpus: float = 0.0,
    max_ongoing_requests: int = 64,
    stats_period_s: float = STATS_PERIOD_S,
):
    """The Ray Serve application: the ingress and ``replicas`` engine replicas of ``model``
    (``LLM`` keywords ``engine_options``; :class:`ServeConfig` fields ``serve_options``, whose
    ``store_dir`` must be a shared ``redis://`` store when given), routed by ``policy``
    (one of :data:`~.routing.POLICIES`) with its ``imbalance`` bound."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    serve_options = dict(serve_options or {})
    store_dir = serve_options.get("store_dir")
    replica = serve.deployment(BlendKVReplica, name="BlendKVReplica").options(
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        health_check_period_s=2.0,
        request_router_config=RequestRouterConfig(
            request_router_class=BlendKVRouter,
            request_router_kwargs={"policy": policy, "imbalance": imbalance},
            request_routing_stats_period_s=stats_period_s,
        ),
    )
    ingress = BlendKVIngress.options(max_ongoing_requests=max(1000, 4 * max_ongoing_requests))
    return ingress.bind(
        replica.bind(model, dict(engine_options or {}), serve_options), store_dir=store_dir
    )


def app_builder(args: dict):
    """``serve run blendkv.entrypoints.ray_serve.app:app_builder model=... store=redis://...
    replicas=2 policy=cost-aware imbalance=2 dtype=bfloat16 ...``: keys it does not
    know are ``LLM`` keywords (their values as Serve passes them: strings)."""
    args = dict(args)
    store = args.pop("store", None)
    return build_app(
        args.pop("model", None),
        replicas=int(args.pop("replicas", 2)),
        policy=args.pop("policy", "cost-aware"),
        imbalance=int(args.pop("imbalance", DEFAULT_IMBALANCE)),
        replica_cpus=float(args.pop("replica_cpus", 1.0)),
        replica_gpus=float(args.pop("replica_gpus", 0.0)),
        serve_options={"store_dir": store} if store else {},
        engine_options=args,
    )


def serve_replicas(
    app, *, host: str, port: int, ray_address: str | None, on_ready=None
) -> None:  # pragma: no cover - the command's loop (run by hand and the benchmark)
    """Run ``app`` on Ray Serve at ``host:port`` until SIGINT/SIGTERM, then shut it down."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="blendkv", route_prefix="/")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if on_ready is not None:
        on_ready()
    try:
        stop.wait()
    finally:
        serve.shutdown()
