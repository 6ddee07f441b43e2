"""What one blended prefill did, as users read it (``RequestOutput.blend_stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class BlendStats:
    """What happened in one blended prefill. Bytes in bytes, times in seconds.

    Where each prompt token's K/V came from (the four parts sum to ``num_prompt_tokens``)::

        | prefix cache | reused, kept as stored | reused, repaired | other tokens computed |
          prefix_cached  reused_tokens_kept       reused_tokens_     other_tokens_computed
          _tokens                                 recomputed         (template, query, ...)
                         |<------------ tokens_reused ------------>|
                                                  |<------- tokens_recomputed ------->|

    ``tokens_recomputed`` counts the rows of the fused prefill: the repaired reused tokens
    *and* every other token it computed (with ProphetKV, the tokens before the first chunk
    count though its first pass computed them), so ``tokens_reused + tokens_recomputed``
    exceeds the prompt by the repaired ones. When a fused prefill ran::

        tokens_reused - reused_tokens_recomputed + tokens_recomputed + prefix_cached_tokens
            == num_prompt_tokens

    When the prefix cache served every chunk token no fused prefill runs: ``tokens_reused`` and
    ``tokens_recomputed`` stay 0 and the other ``num_prompt_tokens - prefix_cached_tokens``
    tokens are an ordinary prefill (``other_tokens_computed`` counts them in both cases).
    """

    num_chunks: int = 0
    chunks_hit: int = 0  # K/V found in the store (memory tier or LMDB)
    chunks_on_device: int = 0  # of which found in the device tier (kv_device_cache_bytes)
    chunks_in_memory: int = 0  # of which found in host memory (memory tier, writer, prefetch)
    chunks_missed: int = 0  # computed now behind the anchor and written back
    tokens_reused: int = 0  # chunk tokens whose stored K/V was loaded
    window_skipped_tokens: int = 0  # token-layers not loaded: unread by that layer's window
    tokens_recomputed: int = 0  # prompt tokens recomputed through the last layer
    reused_tokens_recomputed: int = 0  # of which were reused tokens picked for repair
    prefix_cached_tokens: int = 0  # tokens served by the engine's prefix cache instead
    kv_bytes_loaded: int = 0
    load_seconds: float = 0.0  # store reads + RoPE + writes into KV blocks
    read_seconds: float = 0.0  # of which finding chunks (store reads, memory tier)
    write_seconds: float = 0.0  # of which RoPE + writes into the blocks
    load_hidden_seconds: float = 0.0  # of which ran behind the forward (pipelined loading)
    read_hidden_seconds: float = 0.0  # of the reads, those behind the forward (deferred, CPU)
    chunks_prefetched: int = 0  # read while the request was queued (prefetch_kv)
    prefetch_seconds: float = 0.0  # those reads' time (not in load_seconds nor the step)
    chosen_recompute_ratio: float | None = None  # picked by the loading controller ("auto")
    precompute_seconds: float = 0.0  # computing missed chunks
    store_errors: int = 0  # store calls that failed (e.g. Redis unreachable): chunks recomputed
    ttft: float | None = None
    num_prompt_tokens: int = 0  # the whole prompt: template, chunks, query (set by the engine)
    # Cost of the fused prefill in row-layers (a row through one decoder layer = 1; a row whose
    # Q/K/V only were computed at a selection layer = that share), selection passes included,
    # and what full prefill of the same rows costs.
    row_layers: float = 0.0
    full_row_layers: int = 0
    # The engine's cost check (blendkv.guards.cost_check), for a request that left its config
    # to the engine: "blend", "cheaper_selection" or "full_prefill" ("": no choice made), and
    # the predicted costs behind it, or why no choice was made.
    cost_choice: str = ""
    cost_reason: str = ""
    # Asked for per request (token_map=True): how each prompt token was computed, a
    # blendkv.blend.token_map.TokenMap once the prompt is done; not in to_dict().
    token_map: Any = field(default=None, repr=False, compare=False)

    @property
    def recompute_fraction(self) -> float:
        """Share of the reused tokens that were recomputed (the realised recompute ratio)."""
        return self.reused_tokens_recomputed / self.tokens_reused if self.tokens_reused else 0.0

    @property
    def compute_fraction(self) -> float:
        """Row-layers run / full prefill's row-layers for the same rows (selection included)."""
        return self.row_layers / self.full_row_layers if self.full_row_layers else 0.0

    @property
    def reused_tokens_kept(self) -> int:
        """Reused tokens whose stored K/V was used as is (not repaired)."""
        return self.tokens_reused - self.reused_tokens_recomputed

    @property
    def other_tokens_computed(self) -> int:
        """Prompt tokens neither reused nor from the prefix cache (template, query, suffix):
        always computed."""
        return self.num_prompt_tokens - self.prefix_cached_tokens - self.tokens_reused

    def describe(self) -> str:
        """One line for people: where the prompt's K/V came from, parts that add up."""
        cached = self.prefix_cached_tokens
        return (
            f"{self.num_prompt_tokens} prompt tokens = "
            + (f"{cached} from the prefix cache + " if cached else "")
            + f"{self.reused_tokens_kept} reused as stored + {self.reused_tokens_recomputed} "
            f"reused and repaired + {self.other_tokens_computed} others computed"
        )

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "token_map"}
        d["recompute_fraction"] = self.recompute_fraction
        d["compute_fraction"] = self.compute_fraction
        d["reused_tokens_kept"] = self.reused_tokens_kept
        d["other_tokens_computed"] = self.other_tokens_computed
        verification = getattr(self, "verification", None)  # set by a check on demand
        if verification is not None:
            d["verification"] = verification.to_dict()
        return d
