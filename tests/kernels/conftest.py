"""Triton kernel tests: on a machine without CUDA they run under Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it is set here, before
any test module imports ``blendkv.kernels.triton``. Shapes stay tiny: the interpreter runs every
program instance in NumPy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from blendkv.kernels.attention import AttentionMetadata

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass
class Step:
    """A step's metadata, a randomly filled pool and the step's q/k/v."""

    md: AttentionMetadata
    pool: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim]
    q: torch.Tensor  # [num_tokens, kv_heads * group, head_dim]
    k: torch.Tensor  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor

    def subset(self, keep: torch.Tensor) -> Step:
        """Only the rows in ``keep`` are computed (CacheBlend's scattered rows)."""
        md = self.md.subset(keep, self.md.row_seq_ids())
        return Step(md, self.pool, self.q[keep], self.k[keep], self.v[keep])


def random_step(
    computed: list[int],
    query_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Step:
    """Sequence ``i`` computes positions ``computed[i] .. computed[i] + query_lens[i] - 1``; its
    blocks are a random permutation of the pool (plus spare blocks), the pool is random, so
    keys of positions not computed this step are "already in the pool"."""
    from blendkv.kernels.torch_attention import TorchAttentionBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in zip(computed, query_lens, strict=True)]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used : used + n])
        used += n
    md = TorchAttentionBackend(device).build_metadata(computed, query_lens, tables, block_size)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    pool = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    num_tokens = md.num_tokens

    def rand(*size):
        return torch.randn(size, generator=gen).to(dtype=dtype, device=device)

    q = rand(num_tokens, num_kv_heads * group, head_dim)
    return Step(
        md,
        pool,
        q,
        rand(num_tokens, num_kv_heads, head_dim),
        rand(*q.shape[:1], num_kv_heads, head_dim),
    )


@pytest.fixture
def make_step():
    return random_step


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
