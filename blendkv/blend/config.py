"""How a blended prefill repairs reused chunk K/V (CacheBlend, arXiv 2405.16444 §4, and the
strategies beyond it in :mod:`blendkv.blend.selection` and :mod:`blendkv.blend.correction`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from blendkv.errors import ConfigError

SELECTIONS = ("v_deviation", "k_deviation", "attention", "random", "prophet", "heads")
DEFAULT_TARGET = 1.0  # nats: the fidelity target of a config that sets neither ratio nor target
TARGET = "target"  # recompute_ratio while the engine has to pick it for fidelity_target
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
            layer 0 with ``selection="prophet"``, the default); unset: the least the engine's
            calibration says meets ``fidelity_target``. Tokens
            without reused K/V (template, query, misses) are always recomputed and do not count.
            ``1.0`` reproduces full prefill; ``0.0`` is full reuse: the stored K/V is used at
            every layer, the first included, and only the non-reused tokens run. ``"auto"``:
            the loading controller (:mod:`blendkv.loading.controller`) picks it per request, the
            most that stays hidden behind loading the request's K/V, within
            ``[min_recompute_ratio, max_recompute_ratio]``.
        fidelity_target: nats: how far the answer may drift from full prefill's, as the
            largest next-token KL(full prefill || blend) along the answer; the engine picks
            the smallest recompute ratio whose calibrated 90th percentile of that divergence
            stays within it (``blendkv calibrate``, :mod:`blendkv.guards.calibration`; without
            a calibration, a conservative ratio). Unset: :data:`DEFAULT_TARGET` (1 nat), unless
            ``recompute_ratio`` is given: an explicit ratio runs as given, with no target.
        min_recompute_ratio: the lower bound of ``"auto"`` (the quality floor).
        max_recompute_ratio: the upper bound of ``"auto"`` (the cost cap; the scheduler
            budgets a request at the cap).
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

    # The defaults (ProphetKV's pick, the K correction) are the measured best of the strategies
    # tried, on both evaluated models: docs/guide/blending.md says what they cost. How much it
    # picks is the fidelity target's ratio (docs/guide/fidelity.md).
    recompute_ratio: float | str | None = None
    check_layer: int = 1
    selection: str = "prophet"
    schedule: tuple[tuple[int, float], ...] = ()
    seed: int = 0
    correction: str = "k"
    correction_shrink: float = 32.0
    correction_prior: str = "zero"
    chunk_head_tokens: int = 0
    chunk_samples: int = 0
    reselect: int = 0
    skip_exact: bool = True
    min_recompute_ratio: float = 0.15
    max_recompute_ratio: float = 0.5
    fidelity_target: float | None = None

    def __post_init__(self) -> None:
        self._resolve_ratio()
        for name in ("min_recompute_ratio", "max_recompute_ratio"):
            _check_ratio(name, getattr(self, name))
        if self.min_recompute_ratio > self.max_recompute_ratio:
            raise ConfigError(
                f"min_recompute_ratio ({self.min_recompute_ratio}) must not exceed "
                f"max_recompute_ratio ({self.max_recompute_ratio})"
            )
        r = self.recompute_ratio
        if r not in ("auto", TARGET):
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
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < math.inf:
            raise ConfigError(f"correction_shrink must be a finite number >= 0, got {s!r}")
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

    def _resolve_ratio(self) -> None:
        """An unset ``recompute_ratio`` is ``"target"``: chosen per request from the calibration
        for ``fidelity_target`` (:data:`DEFAULT_TARGET` when that is unset too)."""
        target = self.fidelity_target
        if target is None and self.recompute_ratio in (None, TARGET):
            target = DEFAULT_TARGET
            object.__setattr__(self, "fidelity_target", target)
        if target is not None:
            if isinstance(target, bool) or not isinstance(target, (int, float)):
                raise ConfigError(f"fidelity_target must be a number of nats, got {target!r}")
            if not 0.0 <= target < math.inf:
                raise ConfigError(f"fidelity_target must be >= 0 nats, got {target!r}")
            if self.recompute_ratio not in (None, TARGET):
                raise ConfigError(
                    "give recompute_ratio or fidelity_target, not both: a target lets the "
                    f"engine pick the ratio (got recompute_ratio={self.recompute_ratio!r})"
                )
            object.__setattr__(self, "recompute_ratio", TARGET)

    @property
    def target_mode(self) -> bool:
        """Whether the engine picks the ratio for ``fidelity_target`` (resolved at prepare)."""
        return self.recompute_ratio == TARGET

    @property
    def auto_ratio(self) -> bool:
        """Whether the loading controller picks the ratio per request (``"auto"``)."""
        return self.recompute_ratio == "auto"

    @property
    def planned_ratio(self) -> float:
        """The ratio to budget for: the cap when the controller picks it (or the calibration,
        before it did: the most it may pick)."""
        if self.auto_ratio:
            return self.max_recompute_ratio
        return 1.0 if self.target_mode else float(self.recompute_ratio)

    @property
    def full_reuse(self) -> bool:
        """Whether nothing reused is recomputed (ratio 0.0 and no schedule)."""
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

    def unused_fields(self) -> dict[str, str]:
        """Field -> why this config does not use it (its value changes nothing)."""
        unused = {}
        if self.full_reuse:
            why = "recompute_ratio 0 reuses every layer (no selection)"
            unused.update(check_layer=why, selection=why, reselect=why)
        elif self.selection == "prophet":
            unused["check_layer"] = "selection 'prophet' picks its rows from layer 0"
        if not self.auto_ratio:
            why = "it bounds recompute_ratio 'auto' only"
            unused.update(min_recompute_ratio=why, max_recompute_ratio=why)
        if self.correction == "none":
            why = "correction is 'none'"
            unused.update(correction_shrink=why, correction_prior=why)
        return unused

    def score_at(self, layer_idx: int) -> str:
        """The scoring strategy at a selection layer (re-checks of one-shot scores use V)."""
        if layer_idx != self.first_selection_layer and self.selection in _ONE_SHOT:
            return "v_deviation"
        return self.selection

    def validate_for(self, num_layers: int) -> None:
        """Raise ``ConfigError`` when a selection layer is past a ``num_layers`` model's last
        (for a target, at a ratio below 1, which every ratio the engine may pick shares)."""
        config = self
        if self.target_mode:
            config = dataclasses.replace(self, recompute_ratio=0.5, fidelity_target=None)
        last = max(config.selection_layers(num_layers))
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


def _check_ratio(name: str, value: object, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        extra = f" {alternative}" if alternative else ""
        raise ConfigError(f"{name} must be in [0, 1]{extra}, got {value!r}")
