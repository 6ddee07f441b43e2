"""What one blended prefill did, as users read it (``RequestOutput.blend_stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

_NOT_IN_DICT = ("config", "token_map")


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

    Attributes:
        num_chunks: chunks in the prompt.
        chunks_hit: chunks whose K/V was found in the store (memory tier or LMDB/Redis).
        chunks_on_device: of those, found in the device tier (``kv_device_cache_bytes``).
        chunks_in_memory: of those, found in host memory (memory tier, writer, prefetch).
        chunks_missed: chunks computed now behind the anchor and written back.
        tokens_reused: chunk tokens whose stored K/V was loaded.
        window_skipped_tokens: token-layers not loaded because that layer's sliding window
            does not read them.
        tokens_recomputed: prompt tokens recomputed through the last layer.
        reused_tokens_recomputed: of those, reused tokens picked for repair.
        prefix_cached_tokens: tokens served by the engine's prefix cache instead.
        kv_bytes_loaded: bytes of chunk K/V loaded.
        load_seconds: store reads + RoPE + writes into KV blocks.
        read_seconds: of which finding chunks (store reads, memory tier).
        write_seconds: of which RoPE + writes into the blocks.
        load_hidden_seconds: of which ran behind the forward (pipelined loading).
        read_hidden_seconds: of the reads, those behind the forward (deferred, CPU).
        chunks_prefetched: chunks read while the request was queued (``prefetch_kv``).
        prefetch_seconds: those reads' time (not in ``load_seconds`` nor the step).
        chosen_recompute_ratio: the ratio the loading controller picked (``"auto"``) or, for
            ``fidelity_target``, the ratio it ran at: the calibration's pick moved by the
            engine's fidelity controller (:mod:`blendkv.guards.fidelity_controller`); else None.
        fidelity_target: the request's fidelity target (nats), None without one.
        predicted_recompute_ratio: with a target, the ratio the calibration picks for it (the
            conservative one without a calibration): the floor the controller moves up from.
        calibrated: with a target, whether a calibration picked the ratio (False: no
            calibration for this store and model, the conservative ratio ran).
        calibration_chunks: with a calibration, the chunks each of its prompts held (0: not
            recorded). A request holding many more drifts more than the curve says.
        precompute_seconds: time computing missed chunks.
        store_errors: store calls that failed (e.g. Redis unreachable); their chunks were
            recomputed.
        ttft: the request's time to first token, in seconds (set with the first token).
        num_prompt_tokens: the whole prompt: template, chunks, query (set by the engine).
        row_layers: the fused prefill's cost in row-layers (a row through one decoder layer =
            1; a row whose Q/K/V only were computed at a selection layer = that share),
            selection passes included.
        full_row_layers: what full prefill of the same rows costs in row-layers.
        cost_choice: the engine's cost check (:mod:`blendkv.guards.cost_check`), for a request
            that left its config to the engine: "blend", "cheaper_selection" or
            "full_prefill" ("": no choice made).
        cost_reason: the predicted costs behind that choice, or why none was made.
        config: the :class:`~blendkv.blend.config.BlendConfig` the request blended with, as
            the engine resolved it: a fidelity target's ratio, the cost check's cheaper
            selection (None: nothing blended yet, or full prefill ran).
        token_map: asked for per request (``token_map=True``): how each prompt token was
            computed, a ``blendkv.blend.token_map.TokenMap`` once the prompt is done; not in
            :meth:`to_dict`.
    """

    num_chunks: int = 0
    chunks_hit: int = 0
    chunks_on_device: int = 0
    chunks_in_memory: int = 0
    chunks_missed: int = 0
    tokens_reused: int = 0
    window_skipped_tokens: int = 0
    tokens_recomputed: int = 0
    reused_tokens_recomputed: int = 0
    prefix_cached_tokens: int = 0
    kv_bytes_loaded: int = 0
    load_seconds: float = 0.0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    load_hidden_seconds: float = 0.0
    read_hidden_seconds: float = 0.0
    chunks_prefetched: int = 0
    prefetch_seconds: float = 0.0
    chosen_recompute_ratio: float | None = None
    fidelity_target: float | None = None
    predicted_recompute_ratio: float | None = None
    calibrated: bool | None = None
    calibration_chunks: int | None = None
    precompute_seconds: float = 0.0
    store_errors: int = 0
    ttft: float | None = None
    num_prompt_tokens: int = 0
    row_layers: float = 0.0
    full_row_layers: int = 0
    cost_choice: str = ""
    cost_reason: str = ""
    config: Any = field(default=None, repr=False, compare=False)
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
        """The fields and the derived fractions and counts, as a JSON-ready dict (no
        ``config`` nor ``token_map``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_IN_DICT}
        d["recompute_fraction"] = self.recompute_fraction
        d["compute_fraction"] = self.compute_fraction
        d["reused_tokens_kept"] = self.reused_tokens_kept
        d["other_tokens_computed"] = self.other_tokens_computed
        verification = getattr(self, "verification", None)  # set by a check on demand
        if verification is not None:
            d["verification"] = verification.to_dict()
        return d
