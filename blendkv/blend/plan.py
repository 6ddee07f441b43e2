"""Per-request blend state (kept by the blend connector) and the stats users see."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from blendkv.blend.config import BlendConfig
from blendkv.blend.prompt import BlendedPrompt


@dataclass
class BlendStats:
    """What happened in one blended prefill. Bytes in bytes, times in seconds."""

    num_chunks: int = 0
    chunks_hit: int = 0  # K/V found in the store (memory tier or LMDB)
    chunks_missed: int = 0  # computed now behind the anchor and written back
    tokens_reused: int = 0  # chunk tokens whose stored K/V was loaded
    tokens_recomputed: int = 0  # prompt tokens recomputed through the last layer
    reused_tokens_recomputed: int = 0  # of which were reused tokens picked for repair
    prefix_cached_tokens: int = 0  # tokens served by the engine's prefix cache instead
    kv_bytes_loaded: int = 0
    load_seconds: float = 0.0  # store reads + RoPE + writes into KV blocks
    precompute_seconds: float = 0.0  # computing missed chunks
    ttft: float | None = None

    @property
    def recompute_fraction(self) -> float:
        """Share of the reused tokens that were recomputed (the realised recompute ratio)."""
        return self.reused_tokens_recomputed / self.tokens_reused if self.tokens_reused else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recompute_fraction"] = self.recompute_fraction
        return d


@dataclass
class BlendPlan:
    prompt: BlendedPrompt
    config: BlendConfig
    chunk_keys: list[bytes]
    salt: bytes
    stats: BlendStats = field(default_factory=BlendStats)

    def needs_fusion(self, num_computed_tokens: int) -> bool:
        """True while some chunk token has no K/V in the request's blocks yet."""
        return num_computed_tokens < self.prompt.query_start and self.prompt.num_chunk_tokens > 0

    def estimated_cost(self, num_new_tokens: int, num_layers: int) -> int:
        """Token-budget cost of the fused prefill: full layers + repaired + always-run rows."""
        reused = min(self.prompt.num_chunk_tokens, num_new_tokens)
        fixed = num_new_tokens - reused
        cfg = self.config
        partial = reused * (cfg.first_partial_layer / max(num_layers, 1) + cfg.recompute_ratio)
        return max(1, fixed + int(round(partial)))
