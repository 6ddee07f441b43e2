"""Pure ASGI middleware of the server, outermost first: request id, metrics, API key, body size
limit.

Written against ASGI directly (not Starlette's ``BaseHTTPMiddleware``) so a streamed response
passes through untouched and a client's disconnect still reaches the route.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid

from blendkv.entrypoints.openai.errors import APIError

UNAUTHENTICATED_PATHS = ("/health",)


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_CLIENT_ID = re.compile(rb"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces


class RequestIdMiddleware:
    """Every response carries ``x-request-id`` (errors, 404s and 401s included): the route's own
    (``cmpl-...``), else the client's ``x-request-id`` if it is a sane token, else a new one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        rid = given if _CLIENT_ID.match(given) else uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ReplicaMiddleware:
    """Every response carries ``x-blendkv-replica: NAME``: which replica served it, when the
    server is one of several (``blendkv serve --replicas N``)."""

    def __init__(self, app, name: str) -> None:
        self.app, self.name = app, name.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_name(message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-blendkv-replica", self.name)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_name)


class MetricsMiddleware:
    """Counts every HTTP response by route (known paths, else "other") and status."""

    def __init__(self, app, metrics, routes: set[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = 500

        async def send_and_count(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            self.metrics.observe_http(route, status)


class APIKeyMiddleware:
    """Every path but ``public_paths`` (``/health``, the ``/ui`` page's files, which hold no
    data) needs ``Authorization: Bearer <key>`` (401 otherwise)."""

    def __init__(self, app, api_key: str, public_paths=UNAUTHENTICATED_PATHS) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.public_paths = frozenset(public_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(
                    401,
                    "missing or wrong API key (send 'Authorization: Bearer <key>')",
                    "authentication_error",
                    code="invalid_api_key",
                )
                return await _send_error(send, error)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` with 413, holding at most that much in memory.

    The body is read here (and replayed to the app); an oversized one is read to its end and
    dropped, so the client gets the 413 instead of a reset connection.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            size += len(message.get("body", b""))
            too_big = too_big or size > self.max_bytes
            if not too_big:
                chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if too_big:
            error = APIError(
                413,
                f"the request body is over the limit of {self.max_bytes} bytes",
                code="request_too_large",
            )
            return await _send_error(send, error)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        await self.app(scope, replay, send)
