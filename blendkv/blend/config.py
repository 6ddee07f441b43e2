"""How a blended prefill repairs reused chunk K/V (CacheBlend, arXiv 2405.16444 §4, and the
strategies beyond it in :mod:`blendkv.blend.selection` and :mod:`blendkv.blend.correction`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from blendkv.errors import ConfigError

SELECTIONS = ("v_deviation", "k_deviation", "attention", "random", "prophet", "heads")
CORRECTIONS = ("none", "k", "v", "kv")
CORRECTION_PRIORS = ("pooled", "zero")
# Selections whose score exists only at their one selection layer; re-checks deeper in the
# model (``schedule``, ``reselect``) score these by V deviation.
_ONE_SHOT = ("prophet", "heads", "attention", "random")


@dataclass(frozen=True)
class BlendConfig:
    """Which tokens of the reused chunks are recomputed, where, and how the rest is repaired.

    Attributes:
        recompute_ratio: fraction of *reused* tokens recomputed from ``check_layer`` on (from
            layer 0 with ``selection="prophet"``, the default, at 0.10). Tokens
            without reused K/V (template, query, misses) are always recomputed and do not count.
            ``1.0`` reproduces full prefill; ``0.0`` is full reuse: the stored K/V is used at
            every layer, the first included, and only the non-reused tokens run. ``"auto"``:
            the loading controller (:mod:`blendkv.blend.controller`) picks it per request, the
            most that stays hidden behind loading the request's K/V, within
            ``[min_recompute_ratio, max_recompute_ratio]``.
        min_recompute_ratio / max_recompute_ratio: the bounds of ``"auto"`` (the quality floor
            and the cost cap; the scheduler budgets a request at the cap).
        check_layer: the layer where fresh Q/K/V of every token is compared with the reused K/V
            and the recompute set is chosen. Layers before it run in full.
        selection: ``v_deviation`` (CacheBlend: sum over heads x head_dim of (V_fresh -
            V_reused)^2), ``k_deviation`` (the same on K), ``attention`` (query-aware: the
            attention the query tokens pay each chunk token at the check layer), ``random``
            (a baseline; seeded by ``seed``), ``prophet`` (ProphetKV, arXiv 2602.02579: a first
            pass runs only the non-reused rows over the reused K/V through every layer; the
            attention the query rows pay each chunk token, summed over layers and heads, picks
            the rows, which are then recomputed from layer 0 -- ``check_layer`` is not used) or
            ``heads`` (the first tokens of every chunk, the same number in each).
        schedule: gradual filtering (paper §4.3): ``((layer, ratio), ...)`` with increasing
            layers after ``check_layer`` and decreasing ratios; at each listed layer the recompute
            set shrinks to the ``ratio`` most deviating reused tokens among those still
            recomputed. Empty = one selection at ``check_layer``.
        seed: seed of the ``random`` selection.
        correction: ``none``, ``k`` (default), ``v`` or ``kv``: repair the K and/or V of the
            reused rows that are *not* recomputed (:mod:`blendkv.blend.correction`); ``none``
            is CacheBlend as published. At a selection layer
            the dropped rows keep the fresh K/V computed there (exact); at later layers each
            chunk's kept rows get the mean (fresh - reused) shift of that chunk's recomputed
            rows, per head, shrunk towards a prior with ``n`` such rows:
            ``(sum + correction_shrink * prior) / (n + correction_shrink)``.
        correction_shrink: the pseudo-count of that shrinkage (tokens, >= 0; default 32).
        correction_prior: what a chunk's shift is shrunk towards: ``zero`` (default) or
            ``pooled``, the mean shift of all the sequence's recomputed rows (itself shrunk
            by ``N / (N + correction_shrink)`` for ``N`` such rows).
        chunk_head_tokens: the first this-many tokens of every chunk are always recomputed
            (EPIC/CacheClip "chunk heads"); they count against ``recompute_ratio``.
        chunk_samples: this many rows of every chunk, evenly spaced over it, are always
            recomputed (counted against ``recompute_ratio``): each chunk's correction is then
            estimated from rows spread over the chunk, not only from the top-scored ones.
        reselect: number of re-checks deeper in the model (0, 1 or 2): the set picked at the
            check layer is 1.5 x ``recompute_ratio``, and at ``num_layers * j / (reselect + 1)``
            it shrinks, by fresh V deviation of the rows still computed, to ratios ending at
            0.5 x ``recompute_ratio`` (the mean over the layers stays about the ratio).
        skip_exact: never pick a reused row whose stored K/V is already full prefill's: a
            chunk stored behind exactly the prompt's tokens before it (the first chunk, when
            the anchor is the prompt's own prefix) with a lossless codec. The budget,
            ``recompute_ratio`` of all reused tokens, goes to the other chunks' rows.
    """

    # ProphetKV's pick + K correction at R = 0.10 by default: on all 50 MuSiQue dev examples it
    # has a lower answer KL than V deviation + K at R = 0.15 (the default before) on both
    # SmolLM2-135M and Qwen2.5-0.5B, at the same or a lower TTFT (README, "Fusion strategies").
    recompute_ratio: float | str = 0.10
    check_layer: int = 1
    selection: str = "prophet"
    schedule: tuple[tuple[int, float], ...] = ()
    seed: int = 0
    # K correction on by default: it more than halves V deviation's answer KL at the same
    # ratio and TTFT on SmolLM2-135M and Qwen2.5-0.5B (README, "Fusion strategies").
    correction: str = "k"
    correction_shrink: float = 32.0
    correction_prior: str = "zero"
    chunk_head_tokens: int = 0
    chunk_samples: int = 0
    reselect: int = 0
    skip_exact: bool = True
    min_recompute_ratio: float = 0.15
    max_recompute_ratio: float = 0.5

    def __post_init__(self) -> None:
        for name in ("min_recompute_ratio", "max_recompute_ratio"):
            _check_ratio(name, getattr(self, name))
        if self.min_recompute_ratio > self.max_recompute_ratio:
            raise ConfigError(
                f"min_recompute_ratio ({self.min_recompute_ratio}) must not exceed "
                f"max_recompute_ratio ({self.max_recompute_ratio})"
            )
        r = self.recompute_ratio
        if r != "auto":
            _check_ratio("recompute_ratio", r, "or 'auto'")
        r = self.planned_ratio
        if isinstance(self.check_layer, bool) or not isinstance(self.check_layer, int):
            raise ConfigError(f"check_layer must be an int, got {self.check_layer!r}")
        if self.check_layer < 0:
            raise ConfigError(f"check_layer must be >= 0, got {self.check_layer}")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.correction not in CORRECTIONS:
            raise ConfigError(f"correction must be one of {CORRECTIONS}, got {self.correction!r}")
        if self.correction_prior not in CORRECTION_PRIORS:
            raise ConfigError(
                f"correction_prior must be one of {CORRECTION_PRIORS}, "
                f"got {self.correction_prior!r}"
            )
        s = self.correction_shrink
        if isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0:
            raise ConfigError(f"correction_shrink must be a number >= 0, got {s!r}")
        for name, hi in (("chunk_head_tokens", None), ("chunk_samples", None), ("reselect", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
            if hi is not None and value > hi:
                raise ConfigError(f"{name} must be at most {hi}, got {value}")
        if not isinstance(self.skip_exact, bool):
            raise ConfigError(f"skip_exact must be a bool, got {self.skip_exact!r}")
        if self.reselect and self.schedule:
            raise ConfigError("give either reselect or an explicit schedule, not both")
        object.__setattr__(self, "schedule", tuple((int(l), float(x)) for l, x in self.schedule))
        prev_layer, prev_ratio = self.first_selection_layer, float(r)
        for layer, ratio in self.schedule:
            if layer <= prev_layer or not 0.0 <= ratio <= prev_ratio:
                raise ConfigError(
                    "schedule must list (layer, ratio) with layers increasing after check_layer "
                    f"and ratios not increasing from recompute_ratio; got {self.schedule}"
                )
            prev_layer, prev_ratio = layer, ratio

    @property
    def auto_ratio(self) -> bool:
        return self.recompute_ratio == "auto"

    @property
    def planned_ratio(self) -> float:
        """The ratio to budget for: the cap when the controller picks it."""
        return self.max_recompute_ratio if self.auto_ratio else float(self.recompute_ratio)

    @property
    def full_reuse(self) -> bool:
        return self.recompute_ratio == 0.0 and not self.schedule

    @property
    def first_selection_layer(self) -> int:
        """The layer where reused rows first leave the computed set."""
        return 0 if self.selection == "prophet" else self.check_layer

    @property
    def first_partial_layer(self) -> int:
        """First layer that does not recompute every token (reused K/V is loaded from here)."""
        return 0 if self.full_reuse else self.first_selection_layer

    def selection_layers(self, num_layers: int | None = None) -> dict[int, float]:
        """Layer -> ratio of reused tokens kept from that layer on (``reselect`` needs the
        model's ``num_layers``)."""
        if self.full_reuse:
            return {0: 0.0}
        first, r = self.first_selection_layer, self.planned_ratio
        if not self.reselect or r >= 1.0:
            return {first: r, **dict(self.schedule)}
        if num_layers is None:
            raise ValueError("reselect needs num_layers")
        n = self.reselect
        ratios = [min(1.0, 1.5 * r - j * r / n) for j in range(n + 1)]  # 1.5r .. 0.5r
        layers = {first: ratios[0]}
        for j in range(1, n + 1):
            layer = max(first + j, num_layers * j // (n + 1))
            layers[layer] = ratios[j]
        return layers

    def score_at(self, layer_idx: int) -> str:
        """The scoring strategy at a selection layer (re-checks of one-shot scores use V)."""
        if layer_idx != self.first_selection_layer and self.selection in _ONE_SHOT:
            return "v_deviation"
        return self.selection

    def validate_for(self, num_layers: int) -> None:
        last = max(self.selection_layers(num_layers))
        if last >= num_layers:
            raise ConfigError(
                f"blend layer {last} is out of range for a model with {num_layers} layers"
            )

    def cache_key(self) -> bytes:
        """Identity of the K/V this config produces (salts the prefix-cache hashes)."""
        base = (self.recompute_ratio, self.check_layer, self.selection, self.schedule, self.seed)
        if self.auto_ratio:
            base += (self.min_recompute_ratio, self.max_recompute_ratio)
        plain = not (self.chunk_head_tokens or self.chunk_samples or self.reselect)
        plain = plain and self.skip_exact
        if self.correction == "none" and plain:
            return repr(base).encode()  # what CacheBlend's configs were keyed by before
        shrink = self.correction_shrink if self.correction != "none" else None
        extra = (self.correction, shrink, self.chunk_head_tokens, self.reselect)
        if not self.skip_exact:
            extra += ("recompute exact",)
        if self.correction != "none" and self.correction_prior == "pooled":
            extra += ("pooled prior",)
        if self.chunk_samples:
            extra += ("samples", self.chunk_samples)
        return repr(base + extra).encode()


@dataclass(frozen=True)
class BlendConnectorConfig:
    """The blend KV connector's own settings, passed as
    ``EngineConfig(kv_connector="blend", kv_connector_config=BlendConnectorConfig(...))``
    (the engine never reads them; ``None`` there means these defaults).

    Attributes:
        kv_store_dir: where chunk K/V lives: an LMDB directory, a redis://host:port/db URL
            shared by many processes, or None for a private temporary LMDB store.
        kv_store_max_bytes: the store's byte limit, saved in it (None: the saved one, or none;
            the private temporary store: ``request_cache_bytes`` or min(2 GiB, 10 % of the free
            disk)). Past it the least-recently-used chunks no document owns are evicted, then a
            write raises ``StoreFullError``.
        request_cache_bytes: keep the K/V of chunks computed at query time (documents sent in
            prompts) in a private store of at most this many bytes, read after
            ``kv_store_dir``, never in it (the server sets it). None: they go into the store.
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
        blend_start_gate: at engine start, check that a blend at ratio 1.0 of a canned prompt
            is full prefill, else refuse to blend (:mod:`blendkv.blend.start_gate`). None: on
            unless the environment sets ``BLENDKV_BLEND_GATE=0``.
        blend_cost_check: before a blended request that passed no ``BlendConfig`` runs,
            predict blend and full prefill from this engine's measurements and run the cheaper
            (:mod:`blendkv.blend.cost_policy`); a request's own ``BlendConfig`` always runs as
            given. None: on unless the environment sets ``BLENDKV_BLEND_COST_CHECK=0``.
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
    blend_start_gate: bool | None = None
    blend_cost_check: bool | None = None

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
        for name in ("prefetch_kv", "pipeline_kv_load", "blend_start_gate", "blend_cost_check"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(
                    f"{name} must be None, True or False, got {getattr(self, name)!r}"
                )
        n = self.anchor_boundary_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"anchor_boundary_tokens must be an integer >= 0, got {n!r}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_ratio(name: str, value: object, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        extra = f" {alternative}" if alternative else ""
        raise ConfigError(f"{name} must be in [0, 1]{extra}, got {value!r}")


def blend_connector_config(config: object) -> BlendConnectorConfig:
    """The connector's settings from ``EngineConfig.kv_connector_config`` (None: defaults)."""
    if config is None:
        return BlendConnectorConfig()
    if not isinstance(config, BlendConnectorConfig):
        raise ConfigError(
            "the blend KV connector takes kv_connector_config=BlendConnectorConfig(...) "
            f"(blendkv.blend.config), got {type(config).__name__}: {config!r}"
        )
    return config
