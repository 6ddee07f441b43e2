"""The blend connector's own settings: where chunk K/V is stored, the anchor chunks are
precomputed behind, and how it is loaded (``EngineConfig.kv_connector_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from blendkv.errors import ConfigError

KV_READ_MODES = ("deferred", "in_place", "copy")


@dataclass(frozen=True)
class BlendConnectorConfig:
    """The blend KV connector's own settings, passed as
    ``EngineConfig(kv_connector="blend", kv_connector_config=BlendConnectorConfig(...))``
    (the engine never reads them; ``None`` there means these defaults).

    Attributes:
        kv_store_dir: where chunk K/V lives: an LMDB directory, a redis://host:port/db URL
            shared by many processes, or None for a private temporary LMDB store.
        kv_store_max_bytes: the store's byte limit on disk, saved in it: an LMDB store's file
            stays within it (1 MiB at least), a Redis store refuses it (None: the saved one, or
            none; the private temporary store: ``request_cache_bytes`` or min(2 GiB, 10 % of
            the free disk)). Past it the least-recently-used chunks no document owns are
            evicted, then a write raises ``StoreFullError``.
        request_cache_bytes: keep the K/V of chunks computed at query time (documents sent in
            prompts) in a private LMDB store whose file stays within this many bytes, read
            after ``kv_store_dir``, never in it (the server sets it). None: they go into the
            store.
        kv_store_memory_bytes: the in-RAM tier in front of the store (Redis stores and CUDA
            reads fill it; on the CPU, LMDB chunks are read in place from the page cache).
        kv_device_cache_bytes: CUDA: the most bytes of chunk K/V kept in device memory, read
            before every other tier (no host-to-device copy); a raw chunk read whole from the
            store is kept as its writes copy it in, a computed one as computed. Held beside
            the KV pool (with gpu_memory_utilization, the pool is that much smaller).
            0: off. On the CPU it is one more copy in RAM: leave it off.
        kv_codec: how a new store encodes chunk K/V: none (raw), int8 or int4
            (docs/guide/codecs.md). Unset: an existing store's codec, else none.
        anchor_system: the system prompt of the chat-template prefix every chunk is
            precomputed behind.
        anchor_instruction: the instruction of that prefix.
        anchor_boundary_tokens: also precompute each chunk behind the last N tokens of the
            chunk before it (0: behind the anchor alone); that K/V is reused only where the
            same chunk follows the same neighbour.
        pipeline_kv_load: write loaded chunk K/V into the blocks layer by layer behind the
            forward (a thread on the CPU, a side stream on CUDA); False writes it all first.
            None: on CUDA, and on the CPU only with a core the forward leaves free.
        prefetch_kv: read a queued blended request's chunks in a background thread before its
            step; False reads them in the step that prefills them. None: on with CUDA and for
            LMDB on the CPU; a Redis store on the CPU only with a core torch leaves free.
        prefetch_kv_bytes: the most prefetched K/V held in memory at once (Redis; LMDB on
            CUDA).
        kv_read_mode: how the CPU reads a store it can read in place (LMDB): deferred
            (zero-copy views of the value, read by a thread while the first layers run; the
            fastest), in_place (zero-copy views, read before the forward) or copy (copied out
            of the store before the forward). Benchmarks compare them.
    """

    kv_store_dir: str | None = None
    kv_store_max_bytes: int | None = None
    kv_store_memory_bytes: int = 256 << 20
    kv_device_cache_bytes: int = 0
    kv_codec: str | None = field(default=None, metadata={"choices": ("none", "int8", "int4")})
    request_cache_bytes: int | None = None
    anchor_system: str | None = None
    anchor_instruction: str | None = None
    anchor_boundary_tokens: int = 0
    pipeline_kv_load: bool | None = None
    prefetch_kv: bool | None = None
    prefetch_kv_bytes: int = 1 << 30
    kv_read_mode: str = field(default="deferred", metadata={"choices": KV_READ_MODES})

    def __post_init__(self) -> None:
        for name in ("kv_store_max_bytes", "request_cache_bytes"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _positive("kv_store_memory_bytes", self.kv_store_memory_bytes)
        n = self.kv_device_cache_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"kv_device_cache_bytes must be an integer >= 0, got {n!r}")
        if self.kv_codec not in (None, "none", "int8", "int4"):
            raise ConfigError(f"kv_codec must be none, int8 or int4, got {self.kv_codec!r}")
        n = self.prefetch_kv_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ConfigError(f"prefetch_kv_bytes must be an integer > 0, got {n!r}")
        for name in ("prefetch_kv", "pipeline_kv_load"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(
                    f"{name} must be None, True or False, got {getattr(self, name)!r}"
                )
        if self.kv_read_mode not in KV_READ_MODES:
            raise ConfigError(
                f"kv_read_mode must be one of {KV_READ_MODES}, got {self.kv_read_mode!r}"
            )
        n = self.anchor_boundary_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"anchor_boundary_tokens must be an integer >= 0, got {n!r}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def blend_connector_config(config: object) -> BlendConnectorConfig:
    """The connector's settings from ``EngineConfig.kv_connector_config`` (None: defaults)."""
    if config is None:
        return BlendConnectorConfig()
    if not isinstance(config, BlendConnectorConfig):
        raise ConfigError(
            "the blend KV connector takes kv_connector_config=BlendConnectorConfig(...) "
            f"(blendkv.connector.config), got {type(config).__name__}: {config!r}"
        )
    return config
