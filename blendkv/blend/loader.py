"""Loading chunk K/V into a request's paged blocks for its fused prefill.

Per chunk: read the stored K/V into a reusable buffer (writer's pending set, memory tier, then
LMDB), rotate K to the chunk's fused positions (RoPE of every layer at once) and write K/V of
the layers that read reused K/V into the request's blocks through the attention backend.
Chunks missing from the store are computed first (one forward each behind the anchor), used at
once and handed to the background writer: the step never waits on a disk write. The request's
TTFT includes all of it. On CUDA a stored chunk goes store -> pinned staging buffer -> device
(``non_blocking``), and RoPE plus the block writes are one backend call per chunk
(:meth:`AttentionBackend.load_rotated_kv`).
"""

from __future__ import annotations

import time

import torch

from blendkv.blend.manager import BlendManager
from blendkv.blend.plan import BlendPlan
from blendkv.blend.row_plan import SeqBlend
from blendkv.blend.staging import StagingBuffers


class ChunkLoader:
    def __init__(
        self,
        manager: BlendManager,
        rotary,
        kv_shape: tuple[int, int, int],
        device: torch.device | str = "cpu",
    ) -> None:
        """``kv_shape``: (num_layers, num_kv_heads, head_dim) of a stored chunk."""
        self.manager = manager
        self.rotary = rotary
        self.kv_shape = kv_shape
        self.device = torch.device(device)
        dtype = manager.model.model.embed_tokens.weight.dtype
        self._staging = StagingBuffers(dtype, pinned=self.device.type == "cuda")

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
        cos, sin = self.rotary.tables(self.device)
        table = torch.tensor(block_table, dtype=torch.long)
        block_size = kv_caches[0].shape[2]
        reused = torch.zeros(num_new, dtype=torch.bool)
        for i in todo:
            s, e = spans[i]
            kv = computed.get(i)
            if kv is None:
                kv = self._read(plan.chunk_keys[i], len(plan.prompt.chunks[i]))
                if kv is not None:
                    stats.chunks_hit += 1
                else:  # evicted or corrupt since the lookup: compute it after all
                    kv = self._compute(plan, [i])[i]
            lo = max(s, start)
            positions = torch.arange(lo, e)
            kv = kv[first:, :, lo - s :]  # layers that read reused K/V; positions not cached
            slots = table[positions // block_size] * block_size + positions % block_size
            backend.load_rotated_kv(
                kv_caches,
                first,
                kv,
                positions.to(self.device, non_blocking=True),
                slots.to(self.device, non_blocking=True),
                cos,
                sin,
            )
            reused[lo - start : e - start] = True
            stats.kv_bytes_loaded += kv.numel() * kv.element_size()
        stats.tokens_reused = int(reused.sum())
        stats.store_errors += self.manager.store.connection_errors - errors_before
        precomputed = stats.precompute_seconds - precompute_before
        stats.load_seconds += time.perf_counter() - t0 - precomputed
        gen = torch.Generator().manual_seed(plan.config.seed)
        return SeqBlend(
            index, reused, plan.config, plan.prompt.query_start, stats.tokens_reused, gen, stats
        )

    def _read(self, key: bytes, num_tokens: int) -> torch.Tensor | None:
        """A stored chunk's K/V on the device, or None on a miss.

        On the CPU the value is read straight into a reusable buffer. On CUDA it is read into
        a pinned staging buffer and copied to the device without blocking, so reading the next
        chunk overlaps this chunk's copy.
        """
        num_layers, heads, dim = self.kv_shape
        shape = (num_layers, 2, num_tokens, heads, dim)
        host = self._staging.next(shape)
        if not self.manager.read_into(key, host):
            return None
        if self.device.type == "cpu":
            return host
        out = torch.empty(shape, dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        self._staging.record_use(host)
        return out

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
