"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), ``blendkv serve``.

Routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /version``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /metrics``; blendkv's own under
``/v1/blendkv/`` (:mod:`.extensions`) and the page ``GET /ui`` (:mod:`.ui`). Every HTTP request
is a request in the engine's continuous batch (:class:`~blendkv.entrypoints.async_llm.AsyncLLM`).
The server answers at once; the model loads in a background thread and routes answer 503 until
it is ready. SIGTERM drains (:mod:`.shutdown`).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import tempfile
import threading
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blendkv.engine.detokenizer import logprob_token
from blendkv.entrypoints.async_llm import AsyncLLM, RequestStream
from blendkv.entrypoints.llm import LLM
from blendkv.entrypoints.openai import responses, serving
from blendkv.entrypoints.openai.errors import APIError, api_error, loading_error
from blendkv.entrypoints.openai.extensions import ROUTES as EXTENSION_ROUTES
from blendkv.entrypoints.openai.extensions import add_extension_routes
from blendkv.entrypoints.openai.metrics import ServerMetrics
from blendkv.entrypoints.openai.middleware import (
    UNAUTHENTICATED_PATHS,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    MetricsMiddleware,
    ReplicaMiddleware,
    RequestIdMiddleware,
)
from blendkv.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from blendkv.entrypoints.openai.request_limits import RequestLimits
from blendkv.entrypoints.openai.serve_config import ServeConfig
from blendkv.entrypoints.openai.ui import PAGE, PUBLIC_PATHS, add_ui_routes
from blendkv.rag import RAGPipeline
from blendkv.store.capacity import default_request_cache_bytes

logger = logging.getLogger(__name__)

ROUTES = {
    "/health",
    "/v1/models",
    "/version",
    "/v1/completions",
    "/v1/chat/completions",
    "/metrics",
    PAGE,
    *EXTENSION_ROUTES,
}


class ServerState:
    """The loaded model (``served``), or why there is none yet."""

    def __init__(self, load: Callable[[], LLM], config: ServeConfig, metrics: ServerMetrics):
        self.load, self.config, self.metrics = load, config, metrics
        self.served: serving.Served | None = None
        self.limits: RequestLimits | None = None  # set with served
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self._llm: LLM | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self.draining = False  # shutting down: in-flight requests finish, new ones get 503
        self._streams: set[RequestStream] = set()  # requests added and maybe not finished
        self._streams_lock = threading.Lock()

    def start_loading(self) -> None:
        self._thread = threading.Thread(target=self._load, name="blendkv-load", daemon=True)
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return self.served is not None

    def require(self) -> serving.Served:
        if self.draining:
            raise APIError(
                503, "the server is shutting down", "server_error", code="server_shutting_down"
            )
        if self.served is not None:
            return self.served
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}", "server_error")
        raise loading_error()

    def _load(self) -> None:
        llm = rag = engine = None
        try:
            llm = self._llm = self.load()
            # Documents sent in requests: K/V in a bounded cache, never in the RAG store.
            cache_bytes = self.config.request_cache_bytes
            if cache_bytes is None:
                cache_bytes = default_request_cache_bytes(tempfile.gettempdir())
            llm.blend_manager().use_request_cache(cache_bytes)
            if self.config.store_dir is not None:
                rag = RAGPipeline(
                    self.config.store_dir, llm=llm, store_max_bytes=self.config.store_max_bytes
                )
            # The HTTP side's own tokenizer (logprob tokens, chat templates): the engine thread
            # uses the engine's, and a HF fast tokenizer used by two threads at once can fail
            # ("Already borrowed").
            tokenizer = copy.deepcopy(llm.tokenizer)
            token = functools.lru_cache(maxsize=1 << 16)(
                functools.partial(logprob_token, tokenizer)
            )
            engine = AsyncLLM.from_llm(llm, max_waiting=self.config.max_waiting)
            self.limits = RequestLimits.for_model(
                llm.engine.info.max_model_len,
                self.config.max_request_documents,
                self.config.max_document_tokens,
            )
            self.metrics.attach(engine)
            self.served = serving.Served(
                engine=engine,
                model_name=self.config.served_model_name or llm.engine.info.model_name,
                max_model_len=llm.engine.info.max_model_len,
                rag=rag,
                logprob_token=token,
                vocab_size=llm.engine.info.vocab_size,
                num_layers=llm.engine.info.num_layers,
                tokenizer=tokenizer,
                replica_name=self.config.replica_name,
            )
            logger.info("model %s loaded; serving", self.served.model_name)
            if rag is not None:
                from blendkv.guards.calibration import uncalibrated_note

                note = uncalibrated_note(rag.manager, str(self.config.store_dir))
                if note is not None:
                    logger.warning(note)
            if self._closing.is_set():  # the server stopped while the model loaded
                self.close()
        except BaseException as exc:
            logger.exception("the model failed to load")
            self.load_error = exc
            if engine is not None:
                engine.shutdown()
            if rag is not None:
                rag.close()
            if llm is not None:
                llm.close()
            if self.on_load_error is not None:
                self.on_load_error(exc)

    def track(self, stream: RequestStream) -> None:
        with self._streams_lock:
            self._streams = {s for s in self._streams if not s.finished}
            self._streams.add(stream)

    def open_streams(self) -> list[RequestStream]:
        """The requests added whose last output was not delivered yet."""
        with self._streams_lock:
            return [s for s in self._streams if not s.finished]

    def close(self) -> None:
        """Stop the engine (open requests are aborted), close the store and the model."""
        self._closing.set()
        served, self.served = self.served, None
        if served is None:
            return
        served.engine.shutdown()
        if served.rag is not None:
            served.rag.close()
        self._llm.close()


def create_app(load: Callable[[], LLM] | LLM, config: ServeConfig | None = None) -> FastAPI:
    """The ASGI app. ``load`` builds the LLM (called in a background thread at startup, routes
    answer 503 meanwhile) or is a loaded one; the server closes it at shutdown."""
    config = config or ServeConfig()
    metrics = ServerMetrics(blend_audit_warn_kl=config.blend_audit_warn_kl)
    state = ServerState(load if callable(load) else (lambda: load), config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        try:
            yield
        finally:
            await asyncio.to_thread(state.close)

    app = FastAPI(title="blendkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.blendkv = state
    _add_error_handlers(app)
    _add_routes(app, state)
    add_extension_routes(app, state)
    add_ui_routes(app)
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        public = (*UNAUTHENTICATED_PATHS, *PUBLIC_PATHS)
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key, public_paths=public)
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=ROUTES)
    app.add_middleware(RequestIdMiddleware)
    if config.replica_name is not None:
        app.add_middleware(ReplicaMiddleware, name=config.replica_name)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
            loc = []  # a position in the body, not a parameter
        else:
            where = ".".join(loc) or "body"
            message = f"{where}: {first.get('msg', 'invalid')}"
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more problems)"
        return APIError(400, message, param=loc[0] if loc else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()


def _add_routes(app: FastAPI, state: ServerState) -> None:
    _add_info_routes(app, state)
    _add_completion_route(app, state)
    _add_chat_route(app, state)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    """Health, version, models, the vLLM routes blendkv lacks, and Prometheus metrics."""

    @app.get("/health")
    async def health() -> Response:
        state.require()
        if not state.served.engine.is_running:
            raise APIError(503, "the engine loop has stopped", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        from blendkv import __version__

        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models() -> ModelList:
        served = state.require()
        return ModelList(data=[ModelCard(id=served.model_name, max_model_len=served.max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        served = state.require()
        served.check_model(model_id)
        return ModelCard(id=served.model_name, max_model_len=served.max_model_len)

    @app.api_route("/invocations", methods=["GET", "POST"])
    @app.api_route("/load", methods=["GET", "POST"])
    async def not_built(request: Request) -> Response:  # vLLM routes blendkv does not have
        path = request.url.path
        raise APIError(
            400,
            f"{path} is not supported by blendkv; use /v1/chat/completions or /v1/completions "
            "(load: /metrics)",
            param=path.lstrip("/"),
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_completion_route(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        served = state.require()
        served.check_model(req.model)
        state.limits.check_completion(req.prompt)  # before anything is tokenised
        state.limits.check_max_tokens(req.max_tokens)
        prompt = serving.completion_prompt(req, served.vocab_size)
        params = serving.sampling_params(
            req, req.max_tokens, req.logprobs, vocab_size=served.vocab_size
        )
        opts = _reply_options(req, f"cmpl-{uuid.uuid4().hex}", params.n)
        stream = await _add(state, served, prompt, params, opts.rid, "max_tokens")
        headers = {"x-request-id": opts.rid}
        if req.stream:
            return _sse(responses.completion_stream(served, stream, opts), headers)
        out = await _until_disconnected(request, _last_output(stream))
        if out is None:
            return Response(status_code=499)
        body = responses.completion_response(served, out, opts)
        return JSONResponse(body.model_dump(), headers=headers)


def _add_chat_route(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        served = state.require()
        served.check_model(req.model)
        state.limits.check_chat(req.messages, req.documents)  # before anything is tokenised
        max_tokens, max_tokens_param = serving.chat_max_tokens(req)
        state.limits.check_max_tokens(max_tokens, max_tokens_param)
        params = serving.chat_params(req, served.vocab_size)
        prompt, kwargs = serving.chat_prompt(req, served)
        opts = _reply_options(req, f"chatcmpl-{uuid.uuid4().hex}", params.n)
        opts = dataclasses.replace(opts, top_n=req.top_logprobs or 0)
        stream = await _add(state, served, prompt, params, opts.rid, max_tokens_param, **kwargs)
        headers = {"x-request-id": opts.rid}
        if req.stream:
            return _sse(responses.chat_stream(served, stream, opts), headers)
        out = await _until_disconnected(request, _last_output(stream))
        if out is None:
            return Response(status_code=499)
        body = responses.chat_response(served, out, stream, opts)
        headers.update(responses.blend_headers(out))
        return JSONResponse(body.model_dump(), headers=headers)


def _reply_options(req, rid: str, n: int) -> responses.ReplyOptions:
    so = req.stream_options
    return responses.ReplyOptions(
        rid=rid,
        as_ids=req.return_tokens_as_token_ids,
        include_usage=bool(so and so.include_usage),
        continuous_usage=bool(so and so.include_usage and so.continuous_usage_stats),
        n=n,
    )


async def _add(state: ServerState, served, prompt, params, rid, max_tokens_param, **kwargs):
    """Validate (on the prepare thread) and queue; ``max_tokens_param`` names the request's
    ``max_tokens`` field in errors."""
    check = functools.partial(state.limits.check_prepared, max_tokens_param=max_tokens_param)
    try:
        stream = await served.engine.add_request(prompt, params, rid, check=check, **kwargs)
    except Exception as exc:
        raise api_error(exc) from exc
    state.track(stream)
    return stream


def _sse(events, headers: dict[str, str]) -> StreamingResponse:
    headers = {**headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _last_output(stream):
    out = None
    try:
        async for out in stream:  # noqa: B007  (the last one is the answer)
            pass
    finally:
        stream.close()
    return out


async def _until_disconnected(request: Request, coro):
    """Await ``coro``; if the client disconnects first, cancel it (its ``finally`` aborts the
    request) and return None."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    with suppress(asyncio.CancelledError):
        return await task
    return None  # cancelled: the client is gone
