"""Typed errors raised to users.

Everything a user can cause derives from :class:`BlendKVError`; request-level mistakes also
derive from ``ValueError`` so generic callers can catch them. Invariant violations inside the
engine are plain ``assert``s, never these classes.
"""

from __future__ import annotations


class BlendKVError(Exception):
    """Base class of every error blendkv raises on purpose."""


class InvalidRequestError(BlendKVError, ValueError):
    """A request that cannot be served as given (the engine keeps serving others)."""


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one output token) does not fit in ``max_model_len``."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or of the wrong type."""


class ModelLoadError(BlendKVError):
    """The model path or name cannot be resolved or its weights cannot be read."""


class ConfigError(BlendKVError, ValueError):
    """An engine configuration value is invalid."""
