"""vLLM's engine argument names: accepted where they mean something here, else a typed error."""

from __future__ import annotations

import pytest
import torch
from helpers import QuietLLM

from blendkv.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_kv_cache_memory_bytes
from blendkv.engine_args import check_options, create_engine_config, from_vllm_names
from blendkv.errors import ConfigError

GiB = 1 << 30


def test_vllm_names_that_mean_something_here_are_used():
    config = create_engine_config(
        model="/m",
        dtype="half",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        block_size=8,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=3,
        gpu_memory_utilization=0.5,
        num_gpu_blocks_override=10,
        download_dir="/cache",
    )
    cache = CacheConfig(
        block_size=8, enable_prefix_caching=False, gpu_memory_utilization=0.5, num_kv_blocks=10
    )
    assert config == EngineConfig(
        model="/m",
        dtype="float16",
        max_model_len=128,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        enforce_eager=True,
        seed=3,
        cache=cache,
        cache_dir="/cache",
    )
    assert create_engine_config(dtype=torch.bfloat16).dtype == "bfloat16"
    assert create_engine_config(dtype="float").dtype == "float32"


def test_no_op_values_of_inapplicable_options_are_accepted():
    no_ops = dict(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        distributed_executor_backend=None,
        quantization=None,
        kv_cache_dtype="auto",
        cpu_offload_gb=0,
        swap_space=0,
        tokenizer="/m",
        tokenizer_mode="auto",
        trust_remote_code=True,
        revision=None,
        load_format="auto",
        enable_lora=False,
        speculative_config=None,
        kv_transfer_config=None,
        compilation_config=None,
        scheduling_policy="fcfs",
        task="generate",
        disable_log_stats=True,
    )
    assert create_engine_config(model="/m", **no_ops) == EngineConfig(model="/m")
    check_options(
        {**no_ops, "model": "/m"}, "RAGPipeline"
    )  # RAGPipeline checks its keywords the same way


@pytest.mark.parametrize(
    ("option", "value", "why"),
    [
        ("tensor_parallel_size", 2, "one device"),
        ("pipeline_parallel_size", 4, "one device"),
        ("quantization", "awq", "no quantized kernels"),
        ("kv_cache_dtype", "fp8", "model's dtype"),
        ("swap_space", 4, "recomputed"),
        ("tokenizer", "/other", "model's directory"),
        ("enable_lora", True, "LoRA"),
        ("speculative_config", {"num_speculative_tokens": 2}, "speculative"),
        ("tensor_parallel_size", True, "one device"),  # a bool is not the number 1
    ],
)
def test_other_values_raise_a_typed_error_saying_why(option, value, why):
    with pytest.raises(ConfigError, match=rf"{option}={value!r}.*{why}") as info:
        create_engine_config(model="/m", **{option: value})
    assert "vLLM" in str(info.value)
    with pytest.raises(ConfigError, match=option):
        check_options({option: value}, "RAGPipeline")


def test_every_refused_option_is_named_at_once():
    with pytest.raises(ConfigError) as info:
        QuietLLM(None, tensor_parallel_size=2, quantization="gptq", max_model_len=64)
    assert "tensor_parallel_size=2" in str(info.value) and "quantization='gptq'" in str(info.value)


def test_renamed_option_given_twice_is_refused():
    with pytest.raises(ConfigError, match="num_gpu_blocks_override.*num_kv_blocks"):
        create_engine_config(num_gpu_blocks_override=10, num_kv_blocks=12)
    assert from_vllm_names({"download_dir": "/c"}) == {"cache_dir": "/c"}


def test_unknown_names_still_listed():
    with pytest.raises(ConfigError, match="unknown LLM option.*'gpu_memory_fraction'"):
        create_engine_config(gpu_memory_fraction=0.5)


@pytest.mark.parametrize("value", [0, 0.0, 1.5, -0.1, True, "0.5"])
def test_gpu_memory_utilization_range(value):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=value)


def test_gpu_memory_utilization_sizes_the_pool_from_what_is_left(monkeypatch):
    # 80 GiB card, 30 GiB free once the model is loaded: 50 GiB in use.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GiB, 80 * GiB))
    config = create_engine_config(gpu_memory_utilization=0.9)
    assert resolve_kv_cache_memory_bytes(config, "cuda") == int(0.9 * 80 * GiB) - 50 * GiB
    with pytest.raises(ConfigError, match="leaves no room for the KV pool"):
        resolve_kv_cache_memory_bytes(create_engine_config(gpu_memory_utilization=0.5), "cuda")
    config = create_engine_config(kv_cache_memory_bytes=7)
    assert resolve_kv_cache_memory_bytes(config, "cuda") == 7
    # the blend connector's device tier comes out of the same fraction
    from blendkv.connector.config import BlendConnectorConfig

    tier = BlendConnectorConfig(kv_device_cache_bytes=4 * GiB)
    config = create_engine_config(gpu_memory_utilization=0.9, kv_connector_config=tier)
    assert resolve_kv_cache_memory_bytes(config, "cuda") == int(0.9 * 80 * GiB) - 54 * GiB
    tier = BlendConnectorConfig(kv_device_cache_bytes=30 * GiB)
    with pytest.raises(ConfigError, match="30.0 GiB for the device tier"):
        resolve_kv_cache_memory_bytes(
            create_engine_config(gpu_memory_utilization=0.9, kv_connector_config=tier), "cuda"
        )


def test_gpu_memory_utilization_on_the_cpu_names_the_cpu_options(tiny_llama_dir):
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes or num_kv_blocks"):
        QuietLLM(str(tiny_llama_dir), device="cpu", gpu_memory_utilization=0.9)
    llm = QuietLLM(str(tiny_llama_dir), device="cpu", gpu_memory_utilization=0.9, num_kv_blocks=12)
    assert llm.engine.info.num_kv_blocks == 12  # num_kv_blocks overrides it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_utilization_on_cuda(tiny_llama_dir):
    free_before, total = torch.cuda.mem_get_info()
    assert total - free_before < 0.1 * total, "the test needs a GPU nobody else is using"
    llm = QuietLLM(str(tiny_llama_dir), device="cuda", gpu_memory_utilization=0.3)
    free, _ = torch.cuda.mem_get_info()
    # The KV pool took what was left of 30% of the card: about 30% is in use now.
    assert abs((total - free) - 0.3 * total) < 0.02 * total, (total - free, total)
    assert llm.generate([[5, 6, 7]])[0].outputs[0].token_ids
