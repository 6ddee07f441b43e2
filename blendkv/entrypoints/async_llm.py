"""``AsyncLLM``: the engine behind asyncio callers (the HTTP server), continuously batched.

::

    asyncio callers (event loop)      prepare thread               engine thread (LLMEngine)
    ───────────────────────────       ──────────────────           ─────────────────────────
    add_request ── prompt ──▶ tokenise + validate ── command: add ──▶ run commands (add, abort)
        ▲                                                                 │
        │ RequestStream (one asyncio.Queue per request)                   ▼
        └──── loop.call_soon_threadsafe(put) ◀────── OutputRouter ◀── LLMEngine.step()

One thread owns the (not thread-safe) engine; why a thread: docs/architecture.md, Engine.
Requests are tokenised and validated (``LLMEngine.prepare_request``, which touches no engine
state) on a second thread, so a large request never holds up the steps of the others.
Closing a :class:`RequestStream` early aborts its request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from blendkv.engine.input_processor import PreparedRequest
from blendkv.entrypoints.llm import LLM
from blendkv.entrypoints.router import OutputRouter
from blendkv.errors import BlendKVError
from blendkv.outputs import RequestOutput
from blendkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(BlendKVError):
    """Too many requests are waiting for a place in the batch; retry later (HTTP 429)."""


class EngineDeadError(BlendKVError):
    """The engine loop stopped (shut down, or a step raised); no request can be served."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every loop turn (``AsyncLLM.stats``; read
    from any thread). Counts since the engine started unless said otherwise.

    Attributes:
        num_running: requests in the batch now.
        num_waiting: requests queued for a place in the batch now.
        num_kv_blocks_used: KV blocks held now.
        num_kv_blocks: KV blocks in the pool.
        num_steps: engine steps run.
        num_aborted: requests aborted.
        max_step_requests: the most requests that received a token in one step.
        num_generated_tokens: output tokens sampled (every sample of ``n > 1``).
        num_precomputing: of the waiting, those whose documents are being precomputed now.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks: int = 0
    num_steps: int = 0
    num_aborted: int = 0
    max_step_requests: int = 0
    num_generated_tokens: int = 0
    num_precomputing: int = 0


StepListener = Callable[[list[RequestOutput]], None]


class RequestStream:
    """The outputs of one request, in order, ending with its finished output.

    ``async for out in stream`` yields :class:`RequestOutput`s (``out.delta_text`` is the new
    text). :meth:`close` before the end aborts the request; call it in a ``finally``.

    Attributes:
        request_id: the request's id.
        finished: whether the last output was delivered (or the request was aborted).
        extra: what a prompt callable left for the caller (``AsyncLLM.add_request``; the
            server keeps a RAG query's sources here).
    """

    def __init__(self, request_id: str, owner: AsyncLLM) -> None:
        self.request_id = request_id
        self.finished = False
        self.extra: dict[str, Any] = {}
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Called on the engine thread: hand ``item`` to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless its last output was delivered (idempotent, never blocks)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncLLM:
    """An :class:`~blendkv.LLM` stepped by one engine thread, fed from asyncio.

    ``AsyncLLM(model, **engine_kwargs)`` loads a model like ``LLM``; :meth:`from_llm` wraps an
    existing one (do not call that LLM's own methods while the AsyncLLM runs). ``max_waiting``
    bounds the requests waiting for admission to the batch: one more raises
    :class:`EngineOverloadedError` (None = unbounded).

    Attributes:
        llm: the :class:`~blendkv.LLM` it steps.
        max_waiting: the bound on waiting requests (None: none).
        stats: the latest :class:`EngineStats`.
    """

    def __init__(
        self, model: str | None = None, *, max_waiting: int | None = None, **engine_kwargs: Any
    ) -> None:
        self._init(LLM(model, **engine_kwargs), max_waiting, owns_llm=True)

    @classmethod
    def from_llm(cls, llm: LLM, *, max_waiting: int | None = None) -> AsyncLLM:
        """An AsyncLLM over an existing ``llm``; its ``shutdown`` leaves ``llm`` open."""
        self = cls.__new__(cls)
        self._init(llm, max_waiting, owns_llm=False)
        return self

    def _init(self, llm: LLM, max_waiting: int | None, owns_llm: bool) -> None:
        if max_waiting is not None and (isinstance(max_waiting, bool) or max_waiting < 0):
            raise ValueError(f"max_waiting must be None or an int >= 0, got {max_waiting!r}")
        self.llm = llm
        self.max_waiting = max_waiting
        self._owns_llm = owns_llm
        # Commands for the engine thread; None stops it. _lock orders "is it dead?" + put
        # against the stop draining the queue, so no command is left behind unanswered.
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._router = OutputRouter()
        self._step_listeners: list[StepListener] = []
        self._ids = itertools.count()
        self._pending_adds = 0  # add commands queued but not yet run (they wait too)
        self._num_aborted = 0
        self._max_step_requests = 0
        self._num_steps = 0
        self._dead: BaseException | None = None
        self.stats = EngineStats(num_kv_blocks=llm.engine.info.num_kv_blocks)
        # Tokenising here first makes a fast tokenizer's one-time settings change (truncation,
        # padding off) happen before two threads use it: later encodes and the engine thread's
        # decodes only read it, which HF tokenizers allow from several threads at once.
        llm.tokenizer.encode("warm up", add_special_tokens=False)
        self._prepare = concurrent.futures.ThreadPoolExecutor(1, "blendkv-prepare")
        self._thread = threading.Thread(target=self._run, name="blendkv-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    @property
    def tokenizer(self):
        """The model's tokenizer."""
        return self.llm.tokenizer

    @property
    def is_running(self) -> bool:
        """False once the engine loop has stopped (shut down, or a step raised)."""
        return self._dead is None

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a place in the batch, including adds not yet run."""
        return self.stats.num_waiting + self._pending_adds

    def add_step_listener(self, listener: StepListener) -> None:
        """``listener(outputs)`` runs on the engine thread after every step (metrics)."""
        self._step_listeners.append(listener)

    async def add_request(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        check: Callable[[PreparedRequest], None] | None = None,
        **request_kwargs: Any,
    ) -> RequestStream:
        """Validate and queue a request; its typed errors (``InvalidRequestError``, ...) are
        raised here, before any output. Returns the stream of its outputs.

        ``prompt`` is what ``LLM.generate`` takes, or a callable ``(stream) -> prompt`` called
        on the prepare thread (to render a chat template or retrieve chunks; it may leave
        results in ``stream.extra``). ``check(prepared)`` runs there too, after tokenising
        (server limits; it raises to refuse). ``request_kwargs`` are those of
        ``LLMEngine.prepare_request`` (``blend``, ``logits_from``, ``token_map``).
        """
        self._check_alive()
        self._check_capacity()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stream = RequestStream(rid, self)
        engine = self.llm.engine

        def prepare() -> PreparedRequest:  # on the prepare thread
            p = prompt(stream) if callable(prompt) else prompt
            req = engine.prepare_request(p, sampling_params, rid, **request_kwargs)
            if check is not None:
                check(req)
            return req

        req = await self._prepare_counted(prepare)
        try:
            await self._submit(functools.partial(self._add_prepared, stream, req), counted=True)
        except asyncio.CancelledError:
            self.abort(rid)  # the add still runs after the caller gave up: undo it
            raise
        return stream

    def _check_capacity(self) -> None:
        """Raise EngineOverloadedError when ``max_waiting`` requests are already waiting."""
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise EngineOverloadedError(
                f"{self.num_waiting} requests are already waiting for a place in the batch "
                f"(max_waiting={self.max_waiting}); retry later"
            )

    async def _prepare_counted(self, prepare: Callable[[], PreparedRequest]) -> PreparedRequest:
        """Run ``prepare`` on the prepare thread. The request counts as waiting from now on
        (``max_waiting``) until the engine thread adds it (:meth:`_add_prepared`), or until
        preparing it fails."""
        with self._lock:  # counted as waiting from now on (max_waiting), until it is added
            self._check_alive()
            self._pending_adds += 1
        try:
            try:
                prepared = asyncio.get_running_loop().run_in_executor(self._prepare, prepare)
            except RuntimeError as exc:  # the prepare thread is shut down
                raise EngineDeadError("the engine was shut down") from exc
            return await prepared
        except BaseException:
            with self._lock:
                self._pending_adds -= 1
            raise

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams | None = None, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; leaving the loop early aborts the request."""
        stream = await self.add_request(prompt, sampling_params, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (queued for the engine thread; returns at once, from any thread)."""

        def abort() -> None:
            self._router.unregister(request_id)
            if self.llm.engine.abort_request(request_id):
                self._num_aborted += 1

        self.llm.engine.request_abort(request_id)  # the running step stops its precompute
        self._commands.put(_Command(abort))

    def shutdown(self) -> None:
        """Stop the engine thread (unfinished requests are aborted); close an owned LLM."""
        self._prepare.shutdown(wait=True, cancel_futures=True)
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join()
        if self._owns_llm:
            self.llm.close()

    # ------------------------------------------------------------------ engine thread
    async def _submit(self, fn: Callable[[], Any], *, counted: bool = False) -> Any:
        """Run ``fn`` on the engine thread. ``counted``: an add counted in ``_pending_adds``,
        uncounted here if it is never queued."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            try:
                self._check_alive()
            except EngineDeadError:
                if counted:
                    self._pending_adds -= 1
                raise
            self._commands.put(_Command(fn, fut))
        return await asyncio.wrap_future(fut)

    def _add_prepared(self, stream: RequestStream, req: PreparedRequest) -> None:
        """On the engine thread: add a prepared request, its outputs routed to ``stream``.
        Added or not, it leaves ``_pending_adds``."""
        rid = stream.request_id
        try:
            self._router.register(rid, stream._put)  # before any step can route to it
            try:
                self.llm.engine.add_prepared(req)
            except BaseException:
                self._router.unregister(rid)
                raise
            self._publish_stats()  # counted as waiting before the caller hears back
        finally:
            with self._lock:
                self._pending_adds -= 1

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")

    def _run(self) -> None:
        engine = self.llm.engine
        try:
            while True:
                # Idle: sleep until a command comes. Busy: run what is queued, then step.
                for command in self._take_commands(block=not engine.has_unfinished_requests()):
                    if command is None:
                        self._stop(EngineDeadError("the engine was shut down"))
                        return
                    command.run()
                self._publish_stats()
                if engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:
            logger.exception("the engine loop failed; every request is aborted")
            self._stop(exc)

    def _take_commands(self, block: bool) -> list[_Command | None]:
        commands = []
        try:
            commands.append(self._commands.get(block=block))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _step(self) -> None:
        outputs = self.llm.engine.step()
        self._num_steps += 1
        self._max_step_requests = max(self._max_step_requests, len(outputs))
        self._publish_stats()  # a consumer that gets its last output sees its blocks freed
        self._router.route(outputs)
        for listener in self._step_listeners:
            try:
                listener(outputs)
            except Exception:  # a metrics bug must not stop serving
                logger.exception("step listener %r failed", listener)

    def _publish_stats(self) -> None:
        now = self.llm.engine.stats()
        self.stats = EngineStats(
            num_running=now.num_running,
            num_waiting=now.num_waiting,
            num_kv_blocks_used=now.num_kv_blocks_used,
            num_kv_blocks=now.num_kv_blocks,
            num_steps=self._num_steps,
            num_aborted=self._num_aborted,
            max_step_requests=self._max_step_requests,
            num_generated_tokens=now.num_generated_tokens,
            num_precomputing=now.num_precomputing,
        )

    def _stop(self, exc: BaseException) -> None:
        """Fail every open request and queued command, free the blocks (engine thread)."""
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc))
        with self._lock:
            self._dead = exc
            for command in self._take_commands(block=False):
                if command is not None:
                    command.fail(error)
        for rid in self._router.request_ids():
            sink = self._router.unregister(rid)
            try:
                self.llm.engine.abort_request(rid)
            except Exception:  # the engine may be broken (that is why we stop)
                logger.exception("could not abort %s", rid)
            if sink is not None:
                sink(error)
        try:
            self._publish_stats()
        except Exception:
            logger.exception("could not publish the final engine stats")


@dataclass
class _Command:
    """A function for the engine thread and the future of its caller (None: fire and forget)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future | None = None

    def run(self) -> None:
        # A caller that gave up (cancelled) does not stop the command: an add still runs and
        # the caller's abort, queued behind it, removes the request again.
        live = self.future is not None and self.future.set_running_or_notify_cancel()
        try:
            result = self.fn()
        except BaseException as exc:
            if live:
                self.future.set_exception(exc)
            elif self.future is None:
                logger.exception("engine command failed")
            return
        if live:
            self.future.set_result(result)

    def fail(self, exc: BaseException) -> None:
        if self.future is not None and self.future.set_running_or_notify_cancel():
            self.future.set_exception(exc)
