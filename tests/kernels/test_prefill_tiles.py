"""The prefill kernel's tuned-tile tables (``kernels/triton/prefill_tiles.py``): keys, merging,
a bad file ignored, and the Triton backend's switch between the table and the defaults."""

from __future__ import annotations

import logging

import pytest
import torch

from blendkv.config import KernelConfig
from blendkv.errors import ConfigError
from blendkv.kernels.triton.prefill_tiles import (
    DEFAULT_TILES,
    PrefillTiles,
    load_table,
    table_key,
    table_path,
    tuned_tiles,
    write_table,
)


def test_table_key_and_path():
    assert table_key(4, 128, torch.bfloat16) == "group4_dim128_bfloat16"
    assert table_path((9, 0)).name == "sm90.json"


def test_write_table_merges_and_reloads(tmp_path):
    path = tmp_path / "sm90.json"
    assert load_table(path) == {}
    a, b = PrefillTiles(128, 64, 8, 2), PrefillTiles(64, 128, 4, 2)
    write_table(path, "GPU one", {"group4_dim128_bfloat16": a})
    assert load_table(path) == {"group4_dim128_bfloat16": a}
    write_table(path, "GPU two", {"group7_dim64_bfloat16": b})  # the first key stays
    assert load_table(path) == {"group4_dim128_bfloat16": a, "group7_dim64_bfloat16": b}
    write_table(path, "GPU two", {"group4_dim128_bfloat16": b})  # a key is replaced
    assert load_table(path)["group4_dim128_bfloat16"] == b


@pytest.mark.parametrize(
    "text",
    [
        '{"configs": {"k": {"block_m": 48, "block_n": 32, "num_warps": 4, "num_stages": 2}}}',
        '{"configs": {"k": {"block_m": 64, "tile": 1}}}',
        "not json",
        '{"device": "x"}',
    ],
    ids=["not-a-power-of-two", "unknown-field", "not-json", "no-configs"],
)
def test_a_bad_table_is_ignored_with_a_warning(tmp_path, caplog, text):
    path = tmp_path / "sm90.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        assert load_table(path) == {}
    assert "ignoring the prefill tile table" in caplog.text


def test_shipped_tables_parse():
    """Every table in the package loads whole (a broken one would silently fall back)."""
    from blendkv.kernels.triton.prefill_tiles import TUNED_DIR

    for path in sorted(TUNED_DIR.glob("sm*.json")):
        table = load_table(path)
        assert table and all(isinstance(t, PrefillTiles) for t in table.values()), path


def test_bad_tiles_are_refused():
    with pytest.raises(AssertionError):
        PrefillTiles(block_m=96)
    with pytest.raises(AssertionError):
        PrefillTiles(num_warps=3)


def test_the_cpu_and_the_switch_keep_the_defaults():
    from blendkv.kernels.triton_attention import TritonAttentionBackend

    assert tuned_tiles(torch.device("cpu"), 4, 128, torch.bfloat16) is DEFAULT_TILES
    for tiles in ("tuned", "default"):
        backend = TritonAttentionBackend("cpu", KernelConfig(prefill_tiles=tiles))
        assert backend._prefill_tiles(4, 128, torch.bfloat16) is DEFAULT_TILES


def test_another_generations_table_is_read_by_name():
    """``prefill_tiles="sm90"`` (what ``bench compile --arch 90`` sets) reads the H100 table on
    any device; a bad name is refused."""
    from blendkv.kernels.triton_attention import TritonAttentionBackend

    tiles = load_table(table_path((9, 0)))[table_key(4, 128, torch.bfloat16)]
    assert tiles != DEFAULT_TILES
    backend = TritonAttentionBackend("cpu", KernelConfig(prefill_tiles="sm90"))
    assert backend._prefill_tiles(4, 128, torch.bfloat16) == tiles
    assert KernelConfig(prefill_tiles="sm100").tiles_capability == (10, 0)
    with pytest.raises(ConfigError, match="prefill_tiles"):
        KernelConfig(prefill_tiles="h100")
