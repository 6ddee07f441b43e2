"""One engine replica on Ray Serve: blendkv's own OpenAI server, in process, behind the ingress.

    ingress ── ForwardedRequest ──▶ BlendKVReplica.forward ──▶ the app (create_app), by ASGI
            ◀── ResponseStart, then the body's pieces, as the app sends them (streams stream)

Each replica loads its engine (``LLM``) and, with a store, its RAGPipeline over the shared
store, exactly as ``blendkv serve`` does: the API (documents, ``rag``, streaming, token maps,
``/metrics``) is the app's, untouched. The app is built with ``replica_name`` (the Ray Serve
replica id): responses carry ``x-blendkv-replica`` and blend stats a ``replica`` field.

Ray Serve calls :meth:`BlendKVReplica.record_routing_stats` every few seconds; it returns the
replica's :class:`~.routing.TierSummary` (the digests of the chunk keys in its memory and
device tiers), rebuilt only when the tiers' generation moved, and its
:class:`~.routing.ReplicaCosts`: the seconds a chunk's load costs more from the store than from
its memory tier (the engine's loading controller measures every load), its busy seconds per
finished request (:mod:`.service_clock`, timed around :meth:`BlendKVReplica.forward` for
POST requests) and its requests' mean time to first token (the server's metrics). The router
reads the last ones reported; it never asks a replica per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from blendkv.entrypoints.ray_serve.routing import ReplicaCosts, TierSummary
from blendkv.entrypoints.ray_serve.service_clock import ServiceClock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress hands it on, with the request's chunks (per chunk, the
    digests of its candidate keys) for the router."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    chunks: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class ResponseStart:
    """The first item of a forwarded response: its status and headers."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


class BlendKVReplica:
    """The Ray Serve deployment class of an engine replica (see the module docstring).

    ``engine_options``: ``LLM`` keywords; ``serve_options``: :class:`ServeConfig` fields."""

    def __init__(self, model: str | None, engine_options: dict, serve_options: dict) -> None:
        from ray import serve

        from blendkv import LLM
        from blendkv.entrypoints.openai.api_server import create_app
        from blendkv.entrypoints.openai.serve_config import ServeConfig

        self.name = serve.get_replica_context().replica_id.unique_id
        config = ServeConfig(**serve_options, replica_name=self.name)
        self.app = create_app(lambda: LLM(model, **engine_options), config)
        self.state = self.app.state.blendkv
        self.state.start_loading()
        if not self.state.wait_loaded():  # the replica is ready once its engine is
            raise RuntimeError(f"replica {self.name}: the model failed to load") from (
                self.state.load_error
            )
        self._summary = (None, TierSummary())
        self._clock = ServiceClock()
        self._running: set[asyncio.Task] = set()  # apps still finishing after a disconnect

    @property
    def _connector(self):
        return self.state.served.engine.llm.engine.kv_connector

    def key_recipe(self):
        """What this engine makes chunk keys from (:class:`~.keys.KeyRecipe`)."""
        from blendkv.entrypoints.ray_serve.keys import KeyRecipe

        return KeyRecipe.of(self.state.served.engine.llm.blend_manager())

    def record_routing_stats(self) -> dict:
        """This replica's tier summary and costs (Ray Serve's routing stats), as a dict."""
        connector = self._connector
        generation, memory, device = connector.held_chunks()
        if self._summary[0] != generation:
            self._summary = (generation, TierSummary.of(memory, device, generation))
        costs = ReplicaCosts(
            connector.store_chunk_seconds(),
            self._clock.service_s,
            self.state.metrics.ttft_mean.value,
        )
        return {"tiers": self._summary[1].to_dict(), "costs": costs.to_dict()}

    def check_health(self) -> None:
        served = self.state.served
        if served is None or not served.engine.is_running:
            raise RuntimeError(f"replica {self.name}: the engine loop has stopped")

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Serve ``request`` through the app: its ResponseStart, then its body's pieces. A POST
        (a generation, a document upload) is timed by the service clock; a GET (models,
        metrics) would only pull its mean towards zero."""
        timed = request.method == "POST"
        if timed:
            self._clock.started(time.monotonic())
        try:
            async for item in run_asgi(self.app, request, self._running):
                yield item
        finally:
            if timed:
                self._clock.finished(time.monotonic())

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.close()


async def run_asgi(
    app, request: ForwardedRequest, running: set[asyncio.Task]
) -> AsyncIterator[ResponseStart | bytes]:
    """Run one HTTP request through the ASGI ``app`` in this process, yielding what it sends.
    When the caller stops reading (the client left, or the ingress cancelled), the app sees
    ``http.disconnect`` and aborts the request itself; its task finishes in ``running``."""
    messages: asyncio.Queue = asyncio.Queue()
    finished = object()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers],
        "client": ("ray-serve-ingress", 0),
        "server": ("blendkv-replica", 0),
        "state": {},
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    running.add(task)
    task.add_done_callback(running.discard)
    task.add_done_callback(lambda _: messages.put_nowait(finished))
    try:
        while True:
            message = await messages.get()
            if message is finished:
                task.result()  # the app raised before its response ended: raise it here
                return
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple(message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
