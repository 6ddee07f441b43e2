"""Batch-invariant linear maps (``EngineConfig.deterministic``).

Every linear map of the model (its ``Linear`` modules and fused projections) runs its GEMMs in
tiles of exactly :data:`TILE_ROWS` rows (:func:`blendkv.layers.linear.row_tiled_linear`), so
a row's result never depends on how many rows the step has: the GEMM library sees one shape.
The norms, rotary embeddings, activations and the sampler work row by row already; attention
is made batch-invariant by the backend (:mod:`blendkv.kernels.batch_invariant`).
"""

from __future__ import annotations

from torch import nn

from blendkv.layers.cpu_platform import small_batch_gemms

# Rows per GEMM in deterministic mode: enough for the library's blocked kernel (one row would
# be a matrix-vector product), few enough that a decode step pads little.
TILE_ROWS = 16


def enable_batch_invariance(model: nn.Module, rows: int = TILE_ROWS) -> None:
    """Every linear map of ``model`` in row tiles of ``rows`` from now on (replaces packing)."""
    for gemm in small_batch_gemms(model):
        gemm.enable_row_tiles(rows)
