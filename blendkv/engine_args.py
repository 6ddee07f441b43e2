"""Flat keyword options -> :class:`~blendkv.config.EngineConfig` (vLLM's ``EngineArgs`` idea).

``LLM(model, **kwargs)``, ``RAGPipeline(...)`` and the CLI take one flat set of names: the
engine's own fields, its KV pool's (:class:`CacheConfig`), its guards' (:class:`GuardConfig`),
its prefill kernel's (:class:`KernelConfig`)
and the blend connector's (:class:`BlendConnectorConfig`). This module routes each name to its
layer, so the engine config never names a connector's settings and a user never has to build
the nested configs by hand. The blend package is a plugin loaded by
name (importing blendkv does not load it), so its config class is imported when first needed.

vLLM's engine argument names are accepted too (:func:`from_vllm_names`): most are already the
engine's own (``max_model_len``, ``max_num_seqs``, ``block_size``, ``enforce_eager``,
``gpu_memory_utilization``, ...), two are renamed (``num_gpu_blocks_override``,
``download_dir``), and those that do not apply on one device without quantization
(``tensor_parallel_size``, ``quantization``, ...) pass only with their no-op value; any other
value raises :class:`ConfigError` saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from blendkv.config import CacheConfig, EngineConfig, GuardConfig, KernelConfig, SchedulerConfig
from blendkv.errors import ConfigError

CACHE_OPTIONS = tuple(f.name for f in fields(CacheConfig))
GUARD_OPTIONS = tuple(f.name for f in fields(GuardConfig))
SCHEDULER_OPTIONS = tuple(f.name for f in fields(SchedulerConfig))
KERNEL_OPTIONS = tuple(f.name for f in fields(KernelConfig))
# The flat names of the engine's layers: EngineConfig's own fields and its nested configs'.
ENGINE_OPTIONS = (
    tuple(f.name for f in fields(EngineConfig))
    + CACHE_OPTIONS
    + SCHEDULER_OPTIONS
    + GUARD_OPTIONS
    + KERNEL_OPTIONS
)

# vLLM name -> the engine's name for the same setting.
VLLM_RENAMED = {"num_gpu_blocks_override": "num_kv_blocks", "download_dir": "cache_dir"}

_ONE_DEVICE = "blendkv runs one model on one device"


def _is(*values: object) -> Callable[[object], bool]:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


# vLLM name -> (its values that change nothing here, why other values do not apply).
VLLM_NO_OPS: dict[str, tuple[Callable[[object], bool], str]] = {
    "tensor_parallel_size": (_is(1), _ONE_DEVICE),
    "pipeline_parallel_size": (_is(1), _ONE_DEVICE),
    "data_parallel_size": (_is(1), f"{_ONE_DEVICE}; run one process per device"),
    "distributed_executor_backend": (_is(None), _ONE_DEVICE),
    "disable_custom_all_reduce": (_is(True, False), _ONE_DEVICE),
    "quantization": (_is(None), "weights run in `dtype`; there are no quantized kernels"),
    "kv_cache_dtype": (_is("auto"), "the KV cache (and the chunk store) has the model's dtype"),
    "cpu_offload_gb": (_is(0, 0.0), "weights stay on the device"),
    "swap_space": (_is(0, 0.0), "preempted requests are recomputed, never swapped out"),
    "tokenizer": (_is(None), "the tokenizer is loaded from the model's directory"),
    "tokenizer_mode": (_is("auto"), "the model's fast tokenizer is always used"),
    "trust_remote_code": (_is(True, False), "no code from a checkpoint is ever run"),
    "revision": (_is(None), "models are local directories or GGUF files"),
    "tokenizer_revision": (_is(None), "models are local directories or GGUF files"),
    "code_revision": (_is(None), "models are local directories or GGUF files"),
    "load_format": (_is("auto", "safetensors"), "weights load from safetensors or GGUF"),
    "enable_lora": (_is(False), "LoRA adapters are not supported"),
    "speculative_config": (_is(None), "there is no speculative decoding"),
    "kv_transfer_config": (
        _is(None),
        "external K/V comes through kv_connector and kv_connector_config",
    ),
    "compilation_config": (_is(None), "decode runs CUDA graphs unless enforce_eager=True"),
    "scheduling_policy": (_is("fcfs"), "requests are scheduled first come, first served"),
    "task": (_is("auto", "generate"), "blendkv serves text generation only"),
    "runner": (_is("auto", "generate"), "blendkv serves text generation only"),
    "disable_log_stats": (
        _is(True),
        "there is no periodic stats log (see RequestOutput.metrics and /metrics)",
    ),
}

# vLLM's dtype aliases.
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


def from_vllm_names(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with vLLM's engine argument names turned into the engine's.

    Renamed names are renamed; a no-op vLLM option is dropped when its value changes nothing
    here, and raises :class:`ConfigError` (naming every such option and why) otherwise. A
    ``dtype`` given as vLLM's alias (``"half"``) or a ``torch.dtype`` becomes its name.
    """
    out = dict(options)
    refused = []
    for name, (no_op, why) in VLLM_NO_OPS.items():
        if name not in out:
            continue
        value = out.pop(name)
        if name == "tokenizer" and value is not None and value == options.get("model"):
            continue
        if not no_op(value):
            refused.append(f"{name}={value!r} ({why})")
    if refused:
        raise ConfigError(
            f"vLLM option(s) that do not apply to blendkv: {'; '.join(refused)}; leave them out"
        )
    for vllm_name, name in VLLM_RENAMED.items():
        if vllm_name in out:
            if name in out:
                raise ConfigError(f"{vllm_name} is vLLM's name for {name}: give one of them")
            out[name] = out.pop(vllm_name)
    dtype = out.get("dtype")
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        out["dtype"] = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        out["dtype"] = _DTYPE_ALIASES.get(dtype, dtype)
    return out


def connector_options() -> tuple[str, ...]:
    """The blend connector's option names (:class:`BlendConnectorConfig`'s fields)."""
    # Deferred: `import blendkv` imports this module and must not load blendkv.blend.
    from blendkv.connector.config import BlendConnectorConfig

    return tuple(f.name for f in fields(BlendConnectorConfig))


def check_options(options: dict[str, Any], what: str = "LLM") -> None:
    """Raise :class:`ConfigError` naming every key of ``options`` that is no option at all
    (vLLM's names are options: :func:`from_vllm_names`)."""
    options = from_vllm_names(options)
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        unknown = sorted(set(unknown) - set(connector_options()))
    if unknown:
        raise ConfigError(
            f"unknown {what} option(s) {', '.join(map(repr, unknown))}; valid: "
            f"{', '.join(ENGINE_OPTIONS)} (engine) and {', '.join(connector_options())} "
            "(blend connector)"
        )


def follow_store_dtype(options: dict[str, Any], location: Any) -> dict[str, Any]:
    """``options`` with ``dtype="auto"`` (or no dtype) replaced by the dtype the existing
    store at ``location`` was built with: its K/V serves only a model in that dtype, and
    ``auto`` may resolve otherwise on another machine (bf16 only where the CPU has it
    natively). An explicit dtype, no ``location`` or no store there yet: ``options`` as given.
    An unset ``kv_codec`` likewise follows the store's codec (an explicit other one is refused
    when the store opens, naming both).
    """
    follow_dtype = options.get("dtype", "auto") == "auto"
    follow_codec = options.get("kv_codec") is None
    if location is None or not (follow_dtype or follow_codec):
        return options
    from blendkv.store.backends import stored_fingerprint  # deferred: the store loads torch

    fingerprint = stored_fingerprint(location)
    if fingerprint is None:
        return options
    options = {**options, "dtype": fingerprint.dtype} if follow_dtype else dict(options)
    if follow_codec and fingerprint.kv_codec != "none":
        options["kv_codec"] = fingerprint.kv_codec
    return options


def create_engine_config(**options: Any) -> EngineConfig:
    """The validated :class:`EngineConfig` for flat ``options``.

    A blend connector option (``kv_store_dir``, ``prefetch_kv``, ...) lands in
    ``kv_connector_config``, on top of a :class:`BlendConnectorConfig` given there if any. It is
    refused when ``kv_connector`` is None or another registered name (a factory may build a
    blend connector, so it gets them). vLLM's names are translated first (:func:`from_vllm_names`).
    ``dtype="auto"`` with the ``kv_store_dir`` of an existing store is the store's dtype.
    """
    options = from_vllm_names(options)
    check_options(options)
    options = follow_store_dtype(options, options.get("kv_store_dir"))
    engine = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
    connector = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS}
    layers = (
        ("cache", CacheConfig, CACHE_OPTIONS),
        ("scheduler", SchedulerConfig, SCHEDULER_OPTIONS),
        ("guards", GuardConfig, GUARD_OPTIONS),
        ("kernels", KernelConfig, KERNEL_OPTIONS),
    )
    for name, cls, names in layers:
        flat = {k: engine.pop(k) for k in names if k in engine}
        base = engine.get(name, cls())
        if not isinstance(base, cls):
            raise ConfigError(f"{name} must be a {cls.__name__}, got {base!r}")
        engine[name] = replace(base, **flat)
    if connector:
        from blendkv.connector.config import BlendConnectorConfig  # deferred, as above

        spec = engine.get("kv_connector", "blend")
        if spec is None or (isinstance(spec, str) and spec != "blend"):
            raise ConfigError(
                f"{', '.join(sorted(connector))}: option(s) of the blend KV connector, but "
                f"kv_connector is {spec!r}"
            )
        base = engine.get("kv_connector_config")
        if base is None:
            base = BlendConnectorConfig()
        elif not isinstance(base, BlendConnectorConfig):
            raise ConfigError(
                f"{', '.join(sorted(connector))} given beside kv_connector_config={base!r}, "
                "which is not a BlendConnectorConfig"
            )
        engine["kv_connector_config"] = replace(base, **connector)
    return EngineConfig(**engine)
