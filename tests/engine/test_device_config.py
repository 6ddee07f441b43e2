"""Choosing the device and the attention backend."""

from __future__ import annotations

import pytest
import torch
from helpers import QuietLLM

from blendkv.config import EngineConfig, resolve_attention_backend, resolve_device
from blendkv.errors import ConfigError


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "tpu", 0, None])
def test_bad_device_names_are_refused(device):
    with pytest.raises(ConfigError, match="device must be"):
        EngineConfig(device=device)


def test_bad_backend_name_is_refused():
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


def test_auto_picks_what_torch_sees():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected
    assert resolve_device("cpu") == "cpu"
    assert resolve_attention_backend("auto", "cpu") == "cpu"
    assert resolve_attention_backend("auto", "cuda:1") == "triton"
    assert resolve_attention_backend("torch", "cuda") == "torch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_llama_dir):

    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        QuietLLM(str(tiny_llama_dir), device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_triton_on_the_cpu_needs_the_interpreter(tiny_llama_dir, monkeypatch):

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        QuietLLM(str(tiny_llama_dir), device="cpu", attention_backend="triton")


def test_auto_dtype_is_the_faster_one_on_the_device():
    from blendkv.config import resolve_dtype

    caps = torch.cpu.get_capabilities()
    native = caps.get("amx_bf16") or caps.get("avx512_bf16")
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert resolve_dtype("float16", "cpu") == "float16"
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineConfig(dtype="fp8")


def test_the_store_fingerprint_records_the_resolved_dtype(tiny_llama_dir):

    llm = QuietLLM(str(tiny_llama_dir))  # dtype="auto"
    assert llm.engine.info.dtype in ("float32", "bfloat16")
    assert llm.blend_manager().fingerprint.dtype == llm.engine.info.dtype
    llm.close()


def test_the_cpu_backend_runs_other_dtypes_through_the_torch_reference(tiny_llama_dir):
    from blendkv import SamplingParams

    llm = QuietLLM(str(tiny_llama_dir), attention_backend="cpu", dtype="float16")
    assert llm.engine.attn_backend.name == "cpu"
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    llm.close()
    from blendkv.kernels.backends import get_attention_backend

    with pytest.raises(ValueError, match="runs on the CPU"):
        get_attention_backend("cpu", "cuda")
