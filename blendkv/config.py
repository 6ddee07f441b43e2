"""Engine configuration: frozen, validated on construction, flows down only.

Facts found at run time (how many KV blocks fit, the eos id, the model's shapes) live in
:class:`blendkv.engine.runtime_info.RuntimeInfo`, never written back here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from blendkv.errors import ConfigError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("auto", "torch", "cpu", "triton")
_GEMMS = ("auto", "onednn", "mkl")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: its blocks, how many, and prefix caching (vLLM's ``CacheConfig``).

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks in the pool; overrides kv_cache_memory_bytes.
        kv_cache_memory_bytes: bytes of the KV pool when num_kv_blocks and
            gpu_memory_utilization are None (at most what max_num_seqs sequences of
            max_model_len tokens can fill).
        gpu_memory_utilization: CUDA only (vLLM's option): the fraction of the GPU's memory
            this engine may hold; the KV pool gets what of it is left once the model is
            loaded (memory other processes hold counts as used). Overrides
            kv_cache_memory_bytes; activations are not profiled, they use the rest.
        enable_prefix_caching: reuse the KV blocks of a prompt prefix seen before.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        util = self.gpu_memory_utilization
        if util is not None and (
            isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1
        ):
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """What one engine step takes on (vLLM's ``SchedulerConfig``).

    Attributes:
        max_num_seqs: the most requests in one batch.
        max_num_batched_tokens: the most tokens one step computes.
        enable_chunked_prefill: split long prompts over several steps.
        max_step_latency: seconds: while other requests are in the engine (decoding,
            waiting or precomputing), a step takes at most this much predicted prefill and
            chunk precompute (a long prompt is split, a request's new documents are spread
            over steps), so their tokens keep coming; the prediction is fitted from this
            engine's own steps. A lone request takes full-size steps. None: budget by tokens
            only.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_step_latency: float | None = 0.25

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        latency = self.max_step_latency
        if latency is not None and (
            isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency <= 0
        ):
            raise ConfigError(
                f"max_step_latency must be a positive number of seconds, got {latency!r}"
            )


@dataclass(frozen=True)
class GuardConfig:
    """The engine's guards of answer fidelity (:mod:`blendkv.guards`): policies that watch or
    overrule a KV connector whose K/V is not exactly full prefill's.

    Attributes:
        blend_start_gate: at engine start, check that a blend at ratio 1.0 of a canned prompt
            is full prefill, else refuse to blend (blendkv.guards.start_gate). None: when
            blending is configured (the blend connector was given settings).
        blend_cost_check: before a blended request that passed no BlendConfig runs, predict
            blend and full prefill from this engine's measurements and run the cheaper
            (blendkv.guards.cost_check); a request's own BlendConfig always runs as given.
        blend_audit_rate: the fraction of blended requests that also run full prefill after
            their answer, when the engine is idle, to measure KL(full || blend) along their
            first answer tokens and top-1 agreement (blendkv.guards.audit); drawn with the
            engine's seed. 0: never.
    """

    blend_start_gate: bool | None = None
    blend_cost_check: bool = True
    blend_audit_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.blend_start_gate not in (None, True, False):
            raise ConfigError(
                f"blend_start_gate must be None, True or False, got {self.blend_start_gate!r}"
            )
        if self.blend_cost_check not in (True, False):
            raise ConfigError(
                f"blend_cost_check must be True or False, got {self.blend_cost_check!r}"
            )
        rate = self.blend_audit_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ConfigError(f"blend_audit_rate must be in [0, 1], got {rate!r}")


@dataclass(frozen=True)
class KernelConfig:
    """How the Triton attention backend runs its prefill kernel; the other backends ignore it.
    Benchmarks set these to compare the kernels' choices; the defaults are the fast ones.

    Attributes:
        prefill_split_keys: when a step's prefill tiles are too few to fill the GPU (a few
            recomputed rows over long keys, as in a blend), split each tile's keys over up to
            32 programs and merge their partial results; False: one program per tile.
        prefill_tiles: the prefill kernel's tile sizes: "tuned" (this GPU generation's table,
            ``blendkv/kernels/triton/tuned/smXY.json``, else the defaults), "default" (the
            kernel's defaults), or "smXY" (generation X.Y's table, e.g. "sm90": ``blendkv bench
            compile`` builds another GPU's kernels).
    """

    prefill_split_keys: bool = True
    prefill_tiles: str = "tuned"

    def __post_init__(self) -> None:
        if self.prefill_split_keys not in (True, False):
            raise ConfigError(
                f"prefill_split_keys must be True or False, got {self.prefill_split_keys!r}"
            )
        tiles = self.prefill_tiles
        if not (tiles in ("tuned", "default") or re.fullmatch(r"sm\d{2,3}", str(tiles))):
            raise ConfigError(
                f"prefill_tiles must be 'tuned', 'default' or 'smXY' (a GPU generation, e.g. "
                f"'sm90'), got {tiles!r}"
            )

    @property
    def tiles_capability(self) -> tuple[int, int] | None:
        """The GPU generation whose table "smXY" names ((X, Y)); None otherwise."""
        if not self.prefill_tiles.startswith("sm"):
            return None
        digits = self.prefill_tiles[2:]
        return int(digits[:-1]), int(digits[-1])


@dataclass(frozen=True)
class EngineConfig:
    """Everything the user chooses about the engine when creating an :class:`~blendkv.LLM`.

    Sizes are in tokens unless the name says blocks or bytes. The KV pool's settings are a
    :class:`CacheConfig` (``cache``), the step's a :class:`SchedulerConfig` (``scheduler``),
    the guards' a :class:`GuardConfig` (``guards``), the prefill kernel's a
    :class:`KernelConfig` (``kernels``). A KV
    connector's own settings (the blend connector's store, anchor and loading options) travel
    in ``kv_connector_config``, which the engine hands to the connector unread. ``LLM`` and
    the command line take every field of all six flat (:mod:`blendkv.engine_args`).

    Attributes:
        model: a local HF directory (config.json + safetensors) or a GGUF file; None: the
            embedded SmolLM2-135M-Instruct.
        dtype: auto: the faster on the device (bfloat16 on CUDA; on the CPU bfloat16 only
            with native bf16 dot products, else float32).
        device: where the model, the KV pool and the step tensors live: auto (CUDA when
            torch sees a GPU, else the CPU), cpu, cuda or cuda:N.
        attention_backend: auto: triton on CUDA, cpu (the C++ kernels) on the CPU; torch: the
            plain-torch reference; triton on the CPU runs under TRITON_INTERPRET=1 (tests).
        cpu_gemm: the CPU's GEMM library for the linear maps: auto (oneDNN on CPUs not made by
            Intel, MKL on Intel's, torch's own where neither runs), onednn or mkl (the goldens
            and some benchmarks fix it).
        cache: the KV pool (CacheConfig).
        scheduler: what a step takes on (SchedulerConfig).
        max_model_len: the longest sequence; None: the model's max_position_embeddings.
        enforce_eager: CUDA only: run every step eagerly instead of replaying CUDA graphs
            (decode steps whole; the dense pieces of other steps: max_graph_rows).
        max_graph_rows: CUDA only: the most rows a prefill, blended or mixed step may compute
            for its dense pieces (norms, GEMMs, MLP) to replay CUDA graphs captured per padded
            row count; steps with more rows, and attention always, run eagerly. 0: never.
        kv_connector: the engine extension that brings K/V from outside
            (blendkv.engine.kv_connector): a registered name ("blend", the default), a factory
            ``context -> connector``, or None (dict prompts are then refused).
        kv_connector_config: the connector's own config (for "blend" a
            blendkv.connector.config.BlendConnectorConfig); None: the connector's defaults.
        guards: the fidelity guards (GuardConfig).
        kernels: the Triton prefill kernel's choices (KernelConfig).
        cache_dir: where downloaded and converted models are cached.
        seed: the engine's random seed.
        num_threads: torch intra-op threads; None leaves torch's default.
        prune_last_layer: run attention and the MLP of the last layer only for the rows a
            step reads (every row's K/V is still written); False runs every row through every
            layer.
        deterministic: batch-invariant mode: a request's greedy output (and seeded samples)
            does not depend on what else is in the batch, on the chunking or on prefix-cache
            hits: GEMMs in fixed row tiles, every query row attended as a decode row
            (blendkv.kernels.batch_invariant). Off by default: it costs (docs/benchmarks.md).
    """

    model: str | None = None
    dtype: str = field(default="auto", metadata={"choices": _DTYPES})
    device: str = "auto"
    attention_backend: str = field(default="auto", metadata={"choices": _BACKENDS})
    cpu_gemm: str = field(default="auto", metadata={"choices": _GEMMS})
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None
    enforce_eager: bool = False
    max_graph_rows: int = 2048
    kv_connector: Any = "blend"
    kv_connector_config: Any = None
    guards: GuardConfig = field(default_factory=GuardConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    cache_dir: str | None = None
    seed: int = 0
    num_threads: int | None = None
    prune_last_layer: bool = True
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not _valid_device(self.device):
            raise ConfigError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if self.attention_backend not in _BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.cpu_gemm not in _GEMMS:
            raise ConfigError(f"cpu_gemm must be one of {_GEMMS}, got {self.cpu_gemm!r}")
        if not isinstance(self.cache, CacheConfig):
            raise ConfigError(f"cache must be a CacheConfig, got {self.cache!r}")
        if not isinstance(self.guards, GuardConfig):
            raise ConfigError(f"guards must be a GuardConfig, got {self.guards!r}")
        if not isinstance(self.kernels, KernelConfig):
            raise ConfigError(f"kernels must be a KernelConfig, got {self.kernels!r}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(f"scheduler must be a SchedulerConfig, got {self.scheduler!r}")
        if self.max_graph_rows < 0:
            raise ConfigError(f"max_graph_rows must be >= 0, got {self.max_graph_rows}")
        if not (self.kv_connector is None or isinstance(self.kv_connector, str)):
            if not callable(self.kv_connector):
                raise ConfigError(
                    "kv_connector must be None, a registered name or a factory callable, "
                    f"got {self.kv_connector!r}"
                )
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        sched = self.scheduler
        if not sched.enable_chunked_prefill and self.max_model_len is not None:
            if sched.max_num_batched_tokens < self.max_model_len:
                raise ConfigError(
                    "without chunked prefill max_num_batched_tokens "
                    f"({sched.max_num_batched_tokens}) must be >= max_model_len "
                    f"({self.max_model_len}), or a long prompt could never be scheduled"
                )
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        if self.kv_connector_config is not None and self.kv_connector is None:
            raise ConfigError("kv_connector_config needs a kv_connector (it is None)")


def _valid_device(device: object) -> bool:
    if not isinstance(device, str):
        return False
    if device in ("auto", "cpu", "cuda"):
        return True
    kind, _, index = device.partition(":")
    return kind == "cuda" and index.isdigit()


def resolve_device(device: str) -> str:
    """The device an engine runs on: ``auto`` is CUDA when torch sees a GPU, else the CPU.

    Raises ConfigError when CUDA is asked for and this torch build or machine has none.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={device!r} but torch sees no CUDA GPU (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda}); use device='cpu' or 'auto'"
            )
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: the dtype that runs fastest on ``device``.

    CPUs: bf16 only where AMX or AVX512-BF16 make its kernels native (elsewhere oneDNN converts
    and bf16 runs slower than fp32: docs/benchmarks.md). GPUs: bf16 where supported, else fp16.
    """
    if dtype != "auto":
        return dtype
    import torch

    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    native_bf16 = caps.get("amx_bf16") or caps.get("avx512_bf16")
    return "bfloat16" if native_bf16 else "float32"


def resolve_kv_cache_memory_bytes(config: EngineConfig, device: str) -> int:
    """Bytes for the KV pool: ``kv_cache_memory_bytes``, or with ``gpu_memory_utilization``
    what is left of that fraction of the GPU once the model is loaded (call it then), less the
    device memory the KV connector may hold (its config's ``kv_device_cache_bytes``, if any)."""
    util = config.cache.gpu_memory_utilization
    if util is None:
        return config.cache.kv_cache_memory_bytes
    if not device.startswith("cuda"):
        raise ConfigError(
            f"gpu_memory_utilization={util} applies to CUDA devices; on {device!r} size the KV "
            "pool with kv_cache_memory_bytes or num_kv_blocks"
        )
    import torch

    free, total = torch.cuda.mem_get_info(device)
    held = _device_cache_bytes(config.kv_connector_config)
    left = int(util * total) - (total - free) - held
    if left <= 0:
        also = f" and {held / 2**30:.1f} GiB for the device tier" if held else ""
        raise ConfigError(
            f"gpu_memory_utilization={util} leaves no room for the KV pool: {util} of "
            f"{total / 2**30:.1f} GiB is {util * total / 2**30:.1f} GiB, and "
            f"{(total - free) / 2**30:.1f} GiB are in use with the model loaded{also}; raise it"
        )
    return left


@runtime_checkable
class HoldsDeviceCache(Protocol):
    """A KV connector's config that keeps chunk K/V in device memory (the blend connector's
    ``BlendConnectorConfig``); the engine sees connector configs only through this."""

    kv_device_cache_bytes: int


def _device_cache_bytes(connector_config: object) -> int:
    """The device memory the connector's config says it may hold; 0 for a config without
    ``kv_device_cache_bytes`` (or None)."""
    if isinstance(connector_config, HoldsDeviceCache):
        return connector_config.kv_device_cache_bytes or 0
    return 0


def resolve_attention_backend(name: str, device: str) -> str:
    """``auto``: the Triton kernels on CUDA, the C++ kernels on the CPU."""
    if name == "auto":
        return "triton" if device.startswith("cuda") else "cpu"
    return name


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
