"""blendkv: a RAG serving engine that reuses stored document K/V caches (CacheBlend-style).

from blendkv import LLM, SamplingParams
llm = LLM()                      # embedded SmolLM2-135M-Instruct
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""

from __future__ import annotations

from blendkv.config import EngineConfig
from blendkv.entrypoints.llm import LLM
from blendkv.errors import (
    BlendKVError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelLoadError,
    PromptTooLongError,
)
from blendkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from blendkv.sampling_params import SamplingParams

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
