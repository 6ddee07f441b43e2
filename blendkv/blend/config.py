"""How a blended prefill repairs reused chunk K/V (CacheBlend, arXiv 2405.16444 §4)."""

from __future__ import annotations

from dataclasses import dataclass

from blendkv.errors import ConfigError

SELECTIONS = ("v_deviation", "k_deviation", "attention", "random")


@dataclass(frozen=True)
class BlendConfig:
    """Which tokens of the reused chunks are recomputed, and where.

    Attributes:
        recompute_ratio: fraction of *reused* tokens recomputed from ``check_layer`` on. Tokens
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
            attention the query tokens pay each chunk token at the check layer), or ``random``
            (a baseline; seeded by ``seed``).
        schedule: gradual filtering (paper §4.3): ``((layer, ratio), ...)`` with increasing
            layers after ``check_layer`` and decreasing ratios; at each listed layer the recompute
            set shrinks to the ``ratio`` most deviating reused tokens among those still
            recomputed. Empty = one selection at ``check_layer``.
        seed: seed of the ``random`` selection.
    """

    recompute_ratio: float | str = 0.15
    check_layer: int = 1
    selection: str = "v_deviation"
    schedule: tuple[tuple[int, float], ...] = ()
    seed: int = 0
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
        object.__setattr__(self, "schedule", tuple((int(l), float(x)) for l, x in self.schedule))
        prev_layer, prev_ratio = self.check_layer, float(r)
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
    def first_partial_layer(self) -> int:
        """First layer that does not recompute every token (reused K/V is loaded from here)."""
        return 0 if self.full_reuse else self.check_layer

    def selection_layers(self) -> dict[int, float]:
        """Layer -> ratio of reused tokens kept from that layer on."""
        if self.full_reuse:
            return {0: 0.0}
        return {self.check_layer: self.planned_ratio, **dict(self.schedule)}

    def validate_for(self, num_layers: int) -> None:
        last = max(self.selection_layers())
        if last >= num_layers:
            raise ConfigError(
                f"blend layer {last} is out of range for a model with {num_layers} layers"
            )

    def cache_key(self) -> bytes:
        """Identity of the K/V this config produces (salts the prefix-cache hashes)."""
        fields = (self.recompute_ratio, self.check_layer, self.selection, self.schedule, self.seed)
        if self.auto_ratio:
            fields += (self.min_recompute_ratio, self.max_recompute_ratio)
        return repr(fields).encode()


def _check_ratio(name: str, value: object, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        extra = f" {alternative}" if alternative else ""
        raise ConfigError(f"{name} must be in [0, 1]{extra}, got {value!r}")
