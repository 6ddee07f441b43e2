"""Loading chunk K/V into a request's paged blocks for its fused prefill.

Per chunk: read the stored K/V into a reusable buffer (writer's pending set, memory tier, then
LMDB), rotate K to the chunk's fused positions (RoPE of every layer at once) and write K/V of
the layers that read reused K/V into the request's blocks through the attention backend.
Chunks missing from the store are computed first, all of a step's misses in one forward behind
the anchor, used at once and handed to the background writer: the step never waits on a disk
write. The request's TTFT includes all of it.
"""

from __future__ import annotations

import time

import torch

from blendkv.blend.manager import BlendManager
from blendkv.blend.plan import BlendPlan
from blendkv.blend.row_plan import SeqBlend


class ChunkLoader:
    def __init__(self, manager: BlendManager, rotary, kv_shape: tuple[int, int, int]) -> None:
        """``kv_shape``: (num_layers, num_kv_heads, head_dim) of a stored chunk."""
        self.manager = manager
        self.rotary = rotary
        self.kv_shape = kv_shape
        self._buffer = torch.empty(0, dtype=manager.model.model.embed_tokens.weight.dtype)

    def load(
        self, index: int, plan: BlendPlan, start: int, num_new: int, block_table, kv_caches
    ) -> SeqBlend:
        """Load the chunks of ``plan`` past position ``start`` (the prefix-cache hit) into the
        blocks of ``block_table``; returns the sequence's part of the step's row plan."""
        t0 = time.perf_counter()
        stats = plan.stats
        precompute_before = stats.precompute_seconds
        errors_before = self.manager.store.connection_errors
        stats.prefix_cached_tokens = start
        first = plan.config.first_partial_layer
        spans = plan.prompt.chunk_spans
        todo = [i for i, (_, e) in enumerate(spans) if e > start]
        missing = [i for i in todo if not self.manager.has(plan.chunk_keys[i])]
        computed = self._compute(plan, missing)
        backend = self.manager.attn_backend
        table = torch.tensor(block_table, dtype=torch.long)
        block_size = kv_caches[0].shape[2]
        reused = torch.zeros(num_new, dtype=torch.bool)
        chunk_ids = torch.full((num_new,), -1, dtype=torch.long)
        chunk_offsets = torch.full((num_new,), -1, dtype=torch.long)
        for i in todo:
            s, e = spans[i]
            kv = computed.get(i)
            if kv is None:
                kv = self._buffer_for(len(plan.prompt.chunks[i]))
                if self.manager.read_into(plan.chunk_keys[i], kv):
                    stats.chunks_hit += 1
                else:  # evicted or corrupt since the lookup: compute it after all
                    kv = self._compute(plan, [i])[i]
            lo = max(s, start)
            positions = torch.arange(lo, e)
            kv = kv[first:, :, lo - s :]  # layers that read reused K/V; positions not cached
            k = _rotate_all_layers(self.rotary, positions, kv[:, 0])
            slots = table[positions // block_size] * block_size + positions % block_size
            for layer in range(first, len(kv_caches)):
                backend.write_kv(kv_caches[layer], k[layer - first], kv[layer - first, 1], slots)
            reused[lo - start : e - start] = True
            chunk_ids[lo - start : e - start] = i
            chunk_offsets[lo - start : e - start] = torch.arange(lo - s, e - s)
            stats.kv_bytes_loaded += kv.numel() * kv.element_size()
        stats.tokens_reused = int(reused.sum())
        stats.store_errors += self.manager.store.connection_errors - errors_before
        precomputed = stats.precompute_seconds - precompute_before
        stats.load_seconds += time.perf_counter() - t0 - precomputed
        gen = torch.Generator().manual_seed(plan.config.seed)
        return SeqBlend(
            index,
            reused,
            plan.config,
            plan.prompt.query_start,
            stats.tokens_reused,
            gen,
            stats,
            chunk_ids=chunk_ids,
            chunk_offsets=chunk_offsets,
            num_chunks=len(spans),
        )

    def _compute(self, plan: BlendPlan, misses: list[int]) -> dict[int, torch.Tensor]:
        """Compute the missed chunks in one forward and hand them to the background writer."""
        if not misses:
            return {}
        t0 = time.perf_counter()
        chunks = [plan.prompt.chunks[i] for i in misses]
        kvs = self.manager.compute_kv(chunks)
        self.manager.write_back([plan.chunk_keys[i] for i in misses], chunks, kvs)
        plan.stats.precompute_seconds += time.perf_counter() - t0
        plan.stats.chunks_missed += len(misses)
        return dict(zip(misses, kvs, strict=True))

    def _buffer_for(self, num_tokens: int) -> torch.Tensor:
        """A [L, 2, num_tokens, Hkv, D] view of the reusable read buffer."""
        num_layers, heads, dim = self.kv_shape
        shape = (num_layers, 2, num_tokens, heads, dim)
        numel = num_layers * 2 * num_tokens * heads * dim
        if self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=self._buffer.dtype)
        return self._buffer[:numel].view(shape)


def _rotate_all_layers(rotary, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """RoPE at ``positions`` for K of every layer at once: [L, T, H, D] -> [L, T, H, D]."""
    num_layers, t, h, d = k.shape
    flat = k.permute(1, 0, 2, 3).reshape(t, num_layers * h, d)
    return rotary.rotate_k(positions, flat).reshape(t, num_layers, h, d).permute(1, 0, 2, 3)
