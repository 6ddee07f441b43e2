"""Engine configuration: frozen, validated on construction, flows down only.

Facts found at run time (how many KV blocks fit, the eos id, the model's shapes) live in
:class:`blendkv.engine.llm_engine.RuntimeInfo`, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blendkv.errors import ConfigError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("auto", "torch", "triton")
_CPU_GEMMS = ("auto", "onednn", "mkl")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the user chooses when creating an :class:`~blendkv.LLM`.

    Sizes are in tokens unless the name says blocks or bytes.
    """

    model: str | None = None  # None = embedded SmolLM2-135M-Instruct
    # "auto": the faster on the device (resolve_dtype): bfloat16 on CUDA; on the CPU bfloat16
    # only with native bf16 dot products (AMX / AVX512-BF16), else float32.
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # "auto": triton on CUDA, torch on the CPU. "triton" on the CPU runs the kernels under
    # TRITON_INTERPRET=1 (slow; for tests).
    attention_backend: str = "auto"
    # Where the model, the KV pool and the step tensors live: "auto" (CUDA when available),
    # "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    # CUDA only: run decode steps eagerly instead of replaying captured CUDA graphs.
    enforce_eager: bool = False
    # Engine extension that brings K/V from outside (blendkv.engine.kv_connector): a registered
    # name ("blend": document K/V reuse, the default), a factory ``context -> connector``, or
    # None (dict prompts are then refused).
    kv_connector: Any = "blend"
    cache_dir: str | None = None
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # Blending: where chunk K/V lives (an LMDB directory, a redis://host:port/db URL shared by
    # many processes, or None = a private temporary LMDB store for this process),
    # its byte limits, and the anchor every chunk is precomputed behind (the chat template's
    # prefix with this system prompt / instruction).
    kv_store_dir: str | None = None
    kv_store_max_bytes: int | None = None
    # The in-RAM tier in front of the store: Redis stores and CUDA (pinned) reads fill it; on
    # the CPU, LMDB chunks are read in place from the memory map (the page cache) instead.
    kv_store_memory_bytes: int = 256 << 20
    anchor_system: str | None = None
    anchor_instruction: str | None = None
    # Also precompute each chunk behind the last N tokens of the chunk before it in the prompt
    # (0: behind the anchor alone). Its K/V is then reused only where the same chunk follows
    # the same neighbour; measured in the README ("Anchors").
    anchor_boundary_tokens: int = 0
    # Write loaded chunk K/V into the blocks layer by layer behind the forward (a background
    # thread on the CPU, a side stream on CUDA); False writes everything before the forward.
    # None = on CUDA, and on the CPU only with a core the forward's threads leave free (on a
    # CPU whose cores all compute, the thread measured 1-3 % slower than writing first).
    pipeline_kv_load: bool | None = None
    # Read a queued blended request's chunks in a background thread before its step (LMDB on
    # the CPU: into the page cache, checksum checked; Redis, or LMDB on CUDA: held in memory,
    # at most prefetch_kv_bytes at once); the scheduler lets a request whose reads are under
    # way wait while other work runs. None = on with CUDA and for LMDB on the CPU; a Redis
    # store on the CPU only with a core torch's threads leave free (its reads are CPU work: on
    # a CPU whose cores all compute they slowed the forward beside them by more than they
    # saved). False = chunks are read in the step that prefills them.
    prefetch_kv: bool | None = None
    prefetch_kv_bytes: int = 1 << 30
    # CPU float32 with MKL: GEMMs of (rows/2, rows] rows (decode batches) use weights packed once
    # for ``rows`` rows (blendkv.layers.linear; one more copy of the weights in memory).
    # None = 32 where MKL's packed sgemm runs (float32 on the CPU), else off; 0 = off.
    packed_gemm_rows: int | None = None
    # The most rows one pass through an MLP takes; more run in equal slices. None =
    # on the CPU, the rows whose gate/up output fits 24 MiB (2,048 for SmolLM2, 646 for Qwen2.5
    # 0.5B in float32): glibc hands larger buffers back to the kernel when freed and every
    # layer page-faults them in again (measured: Qwen2.5-0.5B's MLP on 2,048 rows 1.26x
    # faster in slices, SmolLM2's on 6,300 rows 1.28x); elsewhere all rows at once. 0 = all
    # rows at once.
    mlp_rows_per_pass: int | None = None
    # The last layer runs attention, o_proj and the MLP only for the rows a step reads (the
    # last prompt token it samples from, rows of requested prompt logits, decode rows); every
    # row's K/V is still written. Saves about one layer in L of a long prefill (llama.cpp does
    # the same). False runs every row through every layer.
    prune_last_layer: bool = True
    # CPU GEMMs (blendkv.layers.linear): "onednn" = every GEMM through oneDNN on weights packed
    # once (float32, bfloat16); "mkl" = torch's own (float32: MKL's sgemm, packed for decode
    # batches per packed_gemm_rows);
    # "auto" = oneDNN on CPUs not made by Intel (measured 1.2-4.8x faster than MKL on an AMD
    # EPYC), MKL on Intel's. Either keeps a packed copy of the weights in memory.
    cpu_gemm: str = "auto"
    # CPU, torch attention backend, float32 or bfloat16: attend all decode rows of a step with
    # one C++ kernel call per layer (blendkv.kernels.compiled_decode) instead of a flash call
    # per row. Needs a C++ compiler: built for the machine on the first start (~10 s, then
    # cached); if it can't be built, the log says why and decode runs the flash calls.
    # None = on wherever it applies; True = on, an error where it cannot apply; False = off.
    compile_decode: bool | None = None
    # The same for prefill rows (fresh prompts, chunked-prefill chunks, CacheBlend's scattered
    # recomputed rows): one C++ kernel call per sequence and layer
    # (blendkv.kernels.compiled_prefill) instead of SDPA's flash calls. Same values and rules.
    compile_prefill: bool | None = None

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
        for name in ("compile_decode", "compile_prefill"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(
                    f"{name} must be None, True or False, got {getattr(self, name)!r}"
                )
        if not (self.kv_connector is None or isinstance(self.kv_connector, str)):
            if not callable(self.kv_connector):
                raise ConfigError(
                    "kv_connector must be None, a registered name or a factory callable, "
                    f"got {self.kv_connector!r}"
                )
        _positive("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ConfigError(
                    "without chunked prefill max_num_batched_tokens "
                    f"({self.max_num_batched_tokens}) must be >= max_model_len "
                    f"({self.max_model_len}), or a long prompt could never be scheduled"
                )
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        if self.kv_store_max_bytes is not None:
            _positive("kv_store_max_bytes", self.kv_store_max_bytes)
        _positive("kv_store_memory_bytes", self.kv_store_memory_bytes)
        if self.packed_gemm_rows is not None and self.packed_gemm_rows != 0:
            _positive("packed_gemm_rows", self.packed_gemm_rows)
        if self.mlp_rows_per_pass is not None and self.mlp_rows_per_pass != 0:
            _positive("mlp_rows_per_pass", self.mlp_rows_per_pass)
        n = self.prefetch_kv_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ConfigError(f"prefetch_kv_bytes must be an integer > 0, got {n!r}")
        if self.prefetch_kv not in (None, True, False):
            raise ConfigError(f"prefetch_kv must be None, True or False, got {self.prefetch_kv!r}")
        if self.pipeline_kv_load not in (None, True, False):
            raise ConfigError(
                f"pipeline_kv_load must be None, True or False, got {self.pipeline_kv_load!r}"
            )
        if self.cpu_gemm not in _CPU_GEMMS:
            raise ConfigError(f"cpu_gemm must be one of {_CPU_GEMMS}, got {self.cpu_gemm!r}")
        n = self.anchor_boundary_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"anchor_boundary_tokens must be an integer >= 0, got {n!r}")


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

    Measured on this project's CPUs (AVX-512 without BF16 instructions): a bf16 GEMM took 4.5x
    as long as fp32 (oneDNN converts), and a 1024-token prefill 2.9x; on CPUs with AMX or
    AVX512-BF16 the bf16 kernels are native. GPUs: bf16 where supported, else fp16.
    """
    if dtype != "auto":
        return dtype
    import torch

    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    native_bf16 = caps.get("amx_bf16") or caps.get("avx512_bf16")
    return "bfloat16" if native_bf16 else "float32"


def resolve_attention_backend(name: str, device: str) -> str:
    """``auto``: the Triton kernels on CUDA, the torch reference on the CPU."""
    if name == "auto":
        return "triton" if device.startswith("cuda") else "torch"
    return name


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
