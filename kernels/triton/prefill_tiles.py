"""Tile sizes and launch settings of the prefill attention kernel, tuned per GPU generation,
and its launch layout: the row tiles (:func:`build_tiles`) and key parts per tile
(:func:`prefill_num_splits`), from the metadata's host mirrors.

The kernel's defaults (:data:`DEFAULT_TILES`) are what it was written with; a table measured by
``blendkv bench gpu-attention --tune`` on a GPU replaces them for the head shapes it covers.
Tables live beside this file as ``tuned/sm<major><minor>.json`` (one per compute capability:
an H100 and an H200 share their multiprocessors), keyed by :func:`table_key`::

    {"device": "NVIDIA H200", "configs": {"group4_dim128_bfloat16":
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}, ...}}

A shape, dtype or device the table does not cover keeps the defaults. Under the CPU
interpreter, and for any device without a table, nothing is read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from blendkv.kernels.uploads import upload_list

logger = logging.getLogger(__name__)

TUNED_DIR = Path(__file__).parent / "tuned"


@dataclass(frozen=True)
class PrefillTiles:
    """``block_m``: (row, q-head) pairs per program (rows per tile = block_m // group);
    ``block_n``: keys per step of the key loop; ``num_warps`` / ``num_stages``: Triton's."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            assert value >= 16 and value & (value - 1) == 0, (name, value)
        assert self.num_warps in (1, 2, 4, 8, 16), self.num_warps
        assert 1 <= self.num_stages <= 6, self.num_stages

    def as_dict(self) -> dict:
        return asdict(self)


DEFAULT_TILES = PrefillTiles()


def table_key(group: int, head_dim: int, dtype: torch.dtype) -> str:
    """``group4_dim128_bfloat16``: q heads per kv head, head size, K/V cache dtype."""
    return f"group{group}_dim{head_dim}_{str(dtype).removeprefix('torch.')}"


def table_path(capability: tuple[int, int]) -> Path:
    return TUNED_DIR / f"sm{capability[0]}{capability[1]}.json"


@cache
def load_table(path: Path) -> dict[str, PrefillTiles]:
    """The configs of a table file ({} when there is none). A file that does not parse is
    logged and ignored: the kernel then runs with its defaults."""
    if not path.is_file():
        return {}
    try:
        configs = json.loads(path.read_text())["configs"]
        return {key: PrefillTiles(**value) for key, value in configs.items()}
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        logger.warning("ignoring the prefill tile table %s (%s: %s)", path, type(e).__name__, e)
        return {}


def tuned_tiles(
    device: torch.device,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    capability: tuple[int, int] | None = None,
) -> PrefillTiles:
    """The tuned tiles for this device's generation (or ``capability``'s) and head shape, else
    :data:`DEFAULT_TILES`."""
    if capability is None and device.type != "cuda":
        return DEFAULT_TILES
    table = load_table(table_path(capability or torch.cuda.get_device_capability(device)))
    return table.get(table_key(group, head_dim, dtype), DEFAULT_TILES)


def write_table(path: Path, device_name: str, configs: dict[str, PrefillTiles]) -> None:
    """Merge ``configs`` into the table at ``path`` (other keys kept), and forget the cached
    copy so the next lookup reads it."""
    table = {"device": device_name, "configs": {}}
    if path.is_file():
        table = json.loads(path.read_text())
        table["device"] = device_name
    table["configs"].update({key: tiles.as_dict() for key, tiles in configs.items()})
    table["configs"] = dict(sorted(table["configs"].items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n")
    load_table.cache_clear()


def prefill_num_splits(
    num_tiles: int, num_kv_heads: int, max_keys: int, target_programs: int
) -> int:
    """Key parts per tile: 1 when the tiles alone fill ``target_programs`` (about two per GPU
    multiprocessor); else doubled while the programs stay within the target and each part keeps
    at least 256 keys (at most 32 parts)."""
    programs = num_tiles * num_kv_heads
    splits = 1
    if programs == 0:
        return splits
    while splits < 32 and programs * splits * 2 <= target_programs and max_keys >= splits * 2 * 256:
        splits *= 2
    return splits


def block_q_for(group: int, block_m: int = 64) -> int:
    """Query rows per tile: ``block_m`` (row, head) pairs shared by ``group`` heads."""
    return max(1, block_m // group)


def build_tiles(
    query_start_loc_cpu: list[int], seq_ids: list[int], block_q: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_seq_ids, tile_starts) [num_tiles] int32 covering the rows of ``seq_ids``."""
    tile_seqs, tile_starts = [], []
    for seq in seq_ids:
        lo, hi = query_start_loc_cpu[seq], query_start_loc_cpu[seq + 1]
        for start in range(lo, hi, block_q):
            tile_seqs.append(seq)
            tile_starts.append(start)
    if not tile_seqs:  # (no host-to-device copy for an empty table)
        empty = torch.empty(0, dtype=torch.int32, device=device)
        return empty, empty
    return (
        upload_list(tile_seqs, torch.int32, device),
        upload_list(tile_starts, torch.int32, device),
    )
