"""Graceful shutdown: SIGTERM (or Ctrl-C) drains the server instead of cutting it off.

    signal ──▶ draining: /health and new requests get 503; in-flight requests go on
           ──▶ all finished, or ``shutdown_timeout`` seconds passed
           ──▶ the rest are aborted: a stream ends with an SSE error event, a plain request
               gets a 503 body
           ──▶ uvicorn's own shutdown (connections closed, the engine stopped)

A second signal while draining exits at once (uvicorn's usual behaviour). uvicorn's own
``timeout_graceful_shutdown`` only bounds how long it waits for connections after it stopped
listening, so ``/health`` could not say 503 meanwhile: hence this subclass.
"""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from blendkv.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_FLUSH_S = 5.0  # how long aborted streams get to send their final event


def shutting_down_error() -> APIError:
    return APIError(
        503,
        "the server is shutting down; the request was aborted",
        "server_error",
        code="server_shutting_down",
    )


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains ``state`` (an ``api_server.ServerState``)
    for at most ``shutdown_timeout`` seconds before it stops."""

    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self._drain_thread: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drain_thread is not None or self.should_exit:
            return super().handle_exit(sig, frame)
        self._captured_signals.append(sig)  # re-raised by uvicorn after its shutdown
        self.begin_drain()

    def begin_drain(self) -> None:
        """Start draining (from any thread); the server exits when it is done."""
        if self._drain_thread is None:
            self.state.draining = True
            self._drain_thread = threading.Thread(
                target=self._drain, name="blendkv-drain", daemon=True
            )
            self._drain_thread.start()

    def _drain(self) -> None:
        try:
            drain(self.state, self.shutdown_timeout)
        finally:
            self.should_exit = True


def drain(state, timeout: float) -> int:
    """Wait up to ``timeout`` seconds for ``state``'s open requests, then abort the rest with
    :func:`shutting_down_error`; returns how many were aborted."""
    open_streams = state.open_streams()
    if open_streams:
        logger.info("draining %d in-flight request(s), at most %gs", len(open_streams), timeout)
    deadline = time.monotonic() + timeout
    while open_streams and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        open_streams = state.open_streams()
    for stream in open_streams:
        # The stream's consumer (an SSE generator or a route) raises it: a final error event.
        stream._put(shutting_down_error())
        if state.served is not None:
            state.served.engine.abort(stream.request_id)
    if open_streams:
        logger.warning("aborted %d request(s) still running at shutdown", len(open_streams))
        deadline = time.monotonic() + _FLUSH_S
        while state.open_streams() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    return len(open_streams)
