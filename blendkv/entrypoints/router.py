"""``OutputRouter``: hands each engine step's outputs to the consumer of the request they belong to.

``LLMEngine.step`` returns the outputs of every request that produced a token in the batch. A
consumer that steps the engine for its own request must not drop the others' outputs: the
router keeps one sink per request and delivers every output to its request's sink. ``LLM``
(several interleaved ``stream`` iterators, ``generate``) and ``AsyncLLM`` (one asyncio queue
per HTTP request) both route through it. A request without a registered sink has no consumer
and its outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from blendkv.outputs import RequestOutput

Sink = Callable[[RequestOutput], None]


class OutputRouter:
    """request id -> sink; not locked itself: its owner uses it under the lock that orders
    engine calls (``LLM``) or on the engine thread (``AsyncLLM``). A sink runs on the thread
    that stepped, so it must be thread-safe (a deque append, a dict store)."""

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}

    def register(self, request_id: str, sink: Sink) -> None:
        assert request_id not in self._sinks, f"request {request_id!r} already has a consumer"
        self._sinks[request_id] = sink

    def unregister(self, request_id: str) -> Sink | None:
        return self._sinks.pop(request_id, None)

    def route(self, outputs: Iterable[RequestOutput]) -> None:
        """Deliver each output to its request's sink; a finished request's sink is dropped."""
        for out in outputs:
            if out.finished:
                sink = self._sinks.pop(out.request_id, None)
            else:
                sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)

    def request_ids(self) -> list[str]:
        return list(self._sinks)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._sinks

    def __len__(self) -> int:
        return len(self._sinks)
