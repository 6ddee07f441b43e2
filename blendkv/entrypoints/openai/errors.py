"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` and a status.

The engine's typed errors map one to one (:func:`api_error`): a request the engine refuses is a
400 (``PromptTooLongError`` a 413), a full queue a 429, an engine that is loading or stopped a
503. Anything else is a 500 and is logged with its traceback.
"""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse

from blendkv.entrypoints.async_llm import EngineDeadError, EngineOverloadedError
from blendkv.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from blendkv.errors import (
    BlendKVError,
    ConfigError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
)
from blendkv.rag.errors import RAGError

logger = logging.getLogger(__name__)

_PARAM = re.compile(r"^SamplingParams\.(\w+)")


class APIError(Exception):
    """An HTTP error response; raise it from a route."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(exc: BaseException, param_names: dict[str, str] | None = None) -> APIError:
    """The HTTP error for ``exc``; ``param_names`` renames engine parameters to API fields."""
    if isinstance(exc, APIError):
        return exc
    message = str(exc)
    if isinstance(exc, EmptyPromptError):  # e.g. a prompt of text that tokenizes to nothing
        return APIError(400, f"The decoder prompt cannot be empty ({message})", param="prompt")
    if isinstance(exc, PromptTooLongError):
        return APIError(413, message, code="context_length_exceeded")
    if isinstance(exc, InvalidSamplingParamsError):
        m = _PARAM.match(message)
        param = m.group(1) if m else None
        if param is not None:  # the API's name for it, in the message too
            param = (param_names or {}).get(param, param)
            message = param + message[m.end() :]
        return APIError(400, message, param=param, code="invalid_value")
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            429, message, "rate_limit_error", code="server_overloaded", headers={"Retry-After": "1"}
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, message, "server_error", code="engine_unavailable")
    if isinstance(exc, (InvalidRequestError, ConfigError)):
        return APIError(400, message)
    if isinstance(exc, RAGError):  # e.g. retrieval over an empty store
        return APIError(400, message)
    if isinstance(exc, BlendKVError):
        logger.error("request failed: %s", message)
        return APIError(500, message, "server_error")
    logger.error("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", "server_error")


def loading_error() -> APIError:
    return APIError(
        503,
        "the model is still loading; retry shortly",
        "server_error",
        code="model_loading",
        headers={"Retry-After": "5"},
    )
