"""What the blend connector's scheduler side tells its worker side about one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from blendkv.engine.kv_connector import KVConnectorMetadata


@dataclass(frozen=True)
class FusedPrefill:
    """One blended request whose fused prefill runs in this step."""

    index: int  # position of the sequence in the step's batch
    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    block_table: tuple[int, ...]


@dataclass
class BlendConnectorMetadata(KVConnectorMetadata):
    fused: list[FusedPrefill] = field(default_factory=list)
    # Rows of a step of plain prefills only (no fused prefill, no decode): full prefill's rate
    prefill_rows: int = 0
