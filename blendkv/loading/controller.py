"""Loading controller (CacheBlend §5): how much to recompute, and where to read chunks from.

Picks, per request, the largest recompute ratio whose per-layer compute still hides behind the
per-layer load, clamped to ``[min_recompute_ratio, max_recompute_ratio]``::

    ratio = clamp((load / seconds per row-layer - other) / reused, floor, max)

Both rates are moving averages of what this machine measured (one bandwidth per storage tier);
until then, and for loads that hide nothing (serial, reads before the forward), the floor.
A chunk in several tiers is read from the one with the best measured bandwidth. The same rates,
with plain prefill's, predict whether a blend pays at all (:mod:`blendkv.guards.cost_check`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The order tiers are tried in when nothing has been measured yet: fastest first.
TIER_ORDER = ("device", "memory", "lmdb", "redis")


@dataclass
class RateEstimate:
    """Exponential moving average of a rate (units per second)."""

    alpha: float = 0.3
    value: float | None = None

    def update(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value is None else self.value + self.alpha * (rate - self.value)


@dataclass
class MeanEstimate:
    """Exponential moving average of a quantity (seconds a chunk load takes, ...)."""

    alpha: float = 0.3
    value: float | None = None

    def update(self, sample: float) -> None:
        if sample < 0:
            return
        self.value = (
            sample if self.value is None else self.value + self.alpha * (sample - self.value)
        )


@dataclass
class LoadingController:
    alpha: float = 0.3
    bandwidth: dict[str, RateEstimate] = field(default_factory=dict)  # tier -> bytes/s
    # tier -> bytes/s of the part loaded layer by layer behind the forward
    layerwise: dict[str, RateEstimate] = field(default_factory=dict)
    compute: RateEstimate | None = None  # row-layers per second of fused prefills
    # row-layers per second of plain prefill steps (blendkv.guards.cost_check's full prefill)
    full_compute: RateEstimate | None = None
    # tier -> seconds per chunk load (one per write; what a replica reports to its router)
    chunk_loads: dict[str, MeanEstimate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.compute is None:
            self.compute = RateEstimate(self.alpha)
        if self.full_compute is None:
            self.full_compute = RateEstimate(self.alpha)

    # ---- measurements -------------------------------------------------------------------
    def record_load(
        self, tier: str, num_bytes: int, seconds: float, layerwise_seconds: float | None = None
    ) -> None:
        """``num_bytes`` from ``tier`` took ``seconds`` in all, of which ``layerwise_seconds``
        (default: all of them; 0: none, a serial step) were spent layer by layer behind the
        forward. One call is one chunk's load."""
        self.bandwidth.setdefault(tier, RateEstimate(self.alpha)).update(num_bytes, seconds)
        self.chunk_loads.setdefault(tier, MeanEstimate(self.alpha)).update(seconds)
        if layerwise_seconds is None:
            layerwise_seconds = seconds
        estimate = self.layerwise.setdefault(tier, RateEstimate(self.alpha))
        estimate.update(num_bytes, layerwise_seconds)

    def record_compute(self, row_layers: int, seconds: float) -> None:
        self.compute.update(row_layers, seconds)

    def record_full_compute(self, row_layers: int, seconds: float) -> None:
        """A step of plain prefill rows only (no fused prefill, no decode) took ``seconds``."""
        self.full_compute.update(row_layers, seconds)

    def chunk_seconds(self, tier: str) -> float | None:
        """Seconds one chunk's load from ``tier`` takes (read and write, moving average);
        None until one was measured."""
        est = self.chunk_loads.get(tier)
        return None if est is None else est.value

    # ---- decisions ----------------------------------------------------------------------
    def choose_tier(self, tiers: list[str]) -> str:
        """The tier to read a chunk from, among those holding it."""
        assert tiers, "a chunk lives in at least one tier"
        measured = [(self.bandwidth[t].value, t) for t in tiers if self._measured(t)]
        if len(measured) == len(tiers):
            return max(measured)[1]
        return min(tiers, key=lambda t: TIER_ORDER.index(t) if t in TIER_ORDER else 99)

    def choose_ratio(
        self,
        floor: float,
        ceiling: float,
        reused_tokens: int,
        other_tokens: int,
        layer_bytes_by_tier: dict[str, int],
        overlapped: bool = True,
    ) -> float:
        """The recompute ratio for one request.

        Args:
            floor / ceiling: the user's bounds (quality floor, cost cap).
            reused_tokens: chunk tokens whose K/V is loaded; other_tokens: tokens always
                computed (template, query).
            layer_bytes_by_tier: bytes of ONE layer of K/V this request loads from each tier.
            overlapped: whether this step's loading runs behind the forward (pipelined); if
                not, no recompute hides behind it and the answer is the floor.
        """
        if reused_tokens == 0 or not overlapped:
            return floor
        rows_per_second = self.compute.value
        if rows_per_second is None:
            return floor
        load_seconds = 0.0
        for tier, num_bytes in layer_bytes_by_tier.items():
            if num_bytes == 0:
                continue
            estimate = self.layerwise.get(tier)
            if estimate is None or estimate.value is None:
                return floor
            load_seconds += num_bytes / estimate.value
        hidden_rows = load_seconds * rows_per_second - other_tokens
        return min(ceiling, max(floor, hidden_rows / reused_tokens))

    def _measured(self, tier: str) -> bool:
        est = self.bandwidth.get(tier)
        return est is not None and est.value is not None
