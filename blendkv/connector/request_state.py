"""Per-request blend state, kept by the blend connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from blendkv.blend.config import BlendConfig
from blendkv.blend.stats import BlendStats
from blendkv.connector.prompt import BlendedPrompt
from blendkv.engine.scheduler_output import PrecomputeWork


@dataclass
class BlendRequestState:
    """One blended request's prompt, config, chunk keys and stats, kept by the connector."""

    prompt: BlendedPrompt
    config: BlendConfig
    chunk_keys: list[bytes]
    salt: bytes
    stats: BlendStats = field(default_factory=BlendStats)
    # What each chunk is precomputed behind (BlendManager.chunk_contexts); None: the anchor.
    chunk_contexts: list[list[int]] | None = None
    # Chunks whose K/V was not stored when the request came and is not computed yet, by index:
    # the scheduler has the runner compute them (precompute work) before admission.
    missing: list[int] = field(default_factory=list)
    # Chunks computed by that work, index -> K/V, until the fused prefill uses them.
    precomputed: dict[int, Any] = field(default_factory=dict)
    # The request asked for its token map (blendkv.blend.token_map): ``stats.token_map``.
    token_map: bool = False

    def precompute_work(self, request_id: str, anchor_ids: list[int]) -> list[PrecomputeWork]:
        """The forward of each missing chunk: behind its context (None: ``anchor_ids``)."""
        contexts = self.chunk_contexts
        chunks = self.prompt.chunks
        return [
            PrecomputeWork(
                request_id, i, tuple(contexts[i] if contexts else anchor_ids), tuple(chunks[i])
            )
            for i in self.missing
        ]

    def take_precomputed(self) -> dict[int, Any]:
        """The chunks precomputed so far (handed over once: the fused prefill uses them)."""
        done, self.precomputed = self.precomputed, {}
        return done

    def needs_fusion(self, num_computed_tokens: int) -> bool:
        """True while some chunk token has no K/V in the request's blocks yet."""
        return num_computed_tokens < self.prompt.query_start and self.prompt.num_chunk_tokens > 0

    def estimated_cost(self, num_new_tokens: int, num_layers: int) -> int:
        """Token-budget cost of the fused prefill: full layers + repaired + always-run rows."""
        reused = min(self.prompt.num_chunk_tokens, num_new_tokens)
        fixed = num_new_tokens - reused
        cfg = self.config
        partial = reused * (cfg.first_partial_layer / max(num_layers, 1) + cfg.planned_ratio)
        return max(1, fixed + int(round(partial)))
