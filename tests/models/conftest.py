"""Shared fixtures for the model tests.

The embedded-model tests convert the SmolLM2 GGUF once (~30 s) into a cache directory shared by
the whole session and by later runs: ``$BLENDKV_CACHE`` if set, else ``~/.cache/blendkv``
(the engine's own default, so a developer's runs reuse it). Point ``BLENDKV_CACHE`` at a
persistent directory in CI to keep later runs fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from blendkv.kernels.attention import AttentionMetadata

sys.path.insert(0, str(Path(__file__).parent))  # parity.py, the per-family gate's harness


@pytest.fixture(scope="session")
def blendkv_cache_dir() -> Path:
    env = os.environ.get("BLENDKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "blendkv"


class PagedKV:
    """A tiny paged KV pool plus per-sequence block tables, for hand-built AttentionMetadata."""

    def __init__(self, config, num_blocks: int, block_size: int, dtype=torch.float32):
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        shape = (2, num_blocks, block_size, config.num_key_value_heads, head_dim)
        # Large garbage, not zeros: reading a slot that was never written changes the logits.
        # (Not NaN: masked padding slots are legitimately multiplied by a zero weight.)
        gen = torch.Generator().manual_seed(1234)
        self.kv_caches = [
            100 * torch.randn(shape, generator=gen, dtype=dtype)
            for _ in range(config.num_hidden_layers)
        ]
        self.block_size = block_size

    def metadata(self, seqs: list[tuple[list[int], int, list[int]]]) -> AttentionMetadata:
        """``seqs``: per sequence (query positions, seq_len after this step, block table)."""
        bs = self.block_size
        positions, slots, starts = [], [], [0]
        contiguous = []
        max_blocks = max(len(table) for _, _, table in seqs)
        tables = []
        for pos, seq_len, table in seqs:
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            starts.append(starts[-1] + len(pos))
            contiguous.append(pos == list(range(seq_len - len(pos), seq_len)))
            tables.append(table + [0] * (max_blocks - len(table)))
        seq_lens = [seq_len for _, seq_len, _ in seqs]
        return AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor(tables, dtype=torch.int32),
            block_size=bs,
            max_query_len=max(len(p) for p, _, _ in seqs),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            is_contiguous_prefill=contiguous,
        )


@pytest.fixture
def paged_kv():
    return PagedKV
