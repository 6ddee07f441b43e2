"""blendkv: a RAG serving engine that reuses stored document K/V caches (CacheBlend-style).

from blendkv import LLM, SamplingParams
llm = LLM()                      # embedded SmolLM2-135M-Instruct
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from blendkv.openmp_env import set_openmp_defaults

set_openmp_defaults()  # before anything below imports torch (blendkv.openmp_env)

from blendkv.config import EngineConfig  # noqa: E402
from blendkv.errors import (  # noqa: E402
    BlendKVError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelLoadError,
    PromptTooLongError,
)
from blendkv.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from blendkv.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from blendkv.entrypoints.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BlendKVError",
    "CompletionOutput",
    "EmptyPromptError",
    "EngineConfig",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    # LLM loads torch and transformers (seconds): `import blendkv` (the CLI's `--help`, the
    # configs) does not, `blendkv.LLM` does on first use.
    if name == "LLM":
        from blendkv.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'blendkv' has no attribute {name!r}")
