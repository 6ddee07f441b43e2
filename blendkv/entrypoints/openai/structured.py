"""The request fields that ask for structured outputs or prompt logprobs, turned into engine
parameters: OpenAI's ``response_format`` (chat), vLLM's ``structured_outputs`` and its older
``guided_json`` / ``guided_regex`` / ``guided_choice``. At most one may be given; a bad schema
or regex is a 400 naming the field it came in (:mod:`blendkv.engine.structured_output`
compiles it)."""

from __future__ import annotations

from typing import Any

from blendkv.entrypoints.openai.errors import APIError
from blendkv.errors import InvalidSamplingParamsError
from blendkv.sampling_params import StructuredOutputsParams

_KEYS = {"json", "json_object", "regex", "choice"}


def _from_response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if schema is None:
            raise APIError(
                400,
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
        return {"json": schema}
    raise APIError(400, f"response_format {kind!r} is not supported", param="response_format")


def _from_structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    given = {k: v for k, v in value.items() if v not in (None, False)}
    extra = sorted(set(given) - _KEYS)
    if extra:
        raise APIError(
            400,
            f"structured_outputs.{extra[0]} is not supported (json, json_object, regex, choice)",
            param="structured_outputs",
        )
    return given


def structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The request's output constraint, or None; a 400 naming the field for a bad one."""
    sources: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt:
        spec = _from_response_format(fmt)
        if spec is not None:
            sources.append(("response_format", spec))
    if req.structured_outputs is not None:
        sources.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
    ):
        value = getattr(req, name)
        if value is not None:
            sources.append((name, {key: value}))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(n for n, _ in sources)
        raise APIError(400, f"give one output constraint, got {names}", param=sources[1][0])
    name, spec = sources[0]
    try:
        return StructuredOutputsParams(**spec)
    except (InvalidSamplingParamsError, TypeError) as exc:
        raise APIError(400, f"{name}: {exc}", param=name, code="invalid_value") from exc


def check_prompt_logprobs(req: Any, blended: bool) -> None:
    """A 400 for prompt_logprobs where this server cannot give them."""
    if req.prompt_logprobs is None:
        return
    if req.stream:
        raise APIError(
            400, "prompt_logprobs is not supported with stream: true", param="prompt_logprobs"
        )
    if blended:
        raise APIError(
            400,
            "prompt_logprobs is not supported with documents or rag (a blended prompt's reused "
            "chunks are not computed through every layer)",
            param="prompt_logprobs",
        )
