"""The model runner's blend hook: load chunk K/V into a request's blocks, then fuse.

Loading happens inside the step that runs the fused prefill, so the request's TTFT includes
store reads (memory tier, then LMDB), any miss precompute, RoPE at the fused positions and the
writes into the paged KV blocks.
"""

from __future__ import annotations

import time

import torch

from blendkv.blend.fused_forward import SeqBlend, fused_forward
from blendkv.blend.manager import BlendManager
from blendkv.blend.plan import BlendPlan
from blendkv.kernels.torch_attention import write_kv_cache


class BlendExecutor:
    def __init__(self, manager: BlendManager, block_size: int) -> None:
        self.manager = manager
        self.block_size = block_size

    @staticmethod
    def plan_of(seq) -> BlendPlan | None:
        plan = seq.extra
        return plan if isinstance(plan, BlendPlan) else None

    def blending(self, scheduled) -> list[int]:
        """Indices (in the step) of sequences whose fused prefill runs in this step."""
        out = []
        for i, (seq, _) in enumerate(scheduled):
            plan = self.plan_of(seq)
            if plan is not None and plan.needs_fusion(seq.num_computed_tokens):
                out.append(i)
        return out

    def forward(self, model, inputs, scheduled, kv_caches, indices: list[int]):
        blends = [self._load(i, *scheduled[i], kv_caches, model) for i in indices]
        hidden, rows = fused_forward(
            model, inputs.input_ids, inputs.attn_metadata, kv_caches, blends
        )
        self._record(blends, scheduled, rows, inputs.attn_metadata.query_start_loc_cpu)
        return hidden, rows

    def _load(self, index, seq, num_new, kv_caches, model) -> SeqBlend:
        t0 = time.perf_counter()
        plan = self.plan_of(seq)
        stats = plan.stats
        start = seq.num_computed_tokens
        stats.prefix_cached_tokens = start
        first = plan.config.first_partial_layer
        reused = torch.zeros(num_new, dtype=torch.bool)
        rotary = model.model.rotary_emb
        table = torch.tensor(seq.block_table, dtype=torch.long)
        precompute_before = stats.precompute_seconds
        for i, (s, e) in enumerate(plan.prompt.chunk_spans):
            if e <= start:
                continue  # already in the request's blocks (prefix-cache hit)
            kv = self.manager.fetch(plan, i)
            lo = max(s, start)
            positions = torch.arange(lo, e)
            kv = kv[first:, :, lo - s :]  # layers that read reused K/V; positions not cached
            k = _rotate_all_layers(rotary, positions, kv[:, 0])
            slots = (
                table[positions // self.block_size] * self.block_size + positions % self.block_size
            )
            for layer in range(first, len(kv_caches)):
                write_kv_cache(kv_caches[layer], k[layer - first], kv[layer - first, 1], slots)
            reused[lo - start : e - start] = True
            stats.kv_bytes_loaded += kv.numel() * kv.element_size()
        stats.tokens_reused = int(reused.sum())
        load = time.perf_counter() - t0 - (stats.precompute_seconds - precompute_before)
        stats.load_seconds += load
        gen = torch.Generator().manual_seed(plan.config.seed)
        return SeqBlend(
            index, reused, plan.config, plan.prompt.query_start, stats.tokens_reused, gen
        )

    @staticmethod
    def _record(blends, scheduled, rows, starts) -> None:
        for sb in blends:
            stats = scheduled[sb.index][0].extra.stats
            lo, hi = starts[sb.index], starts[sb.index + 1]
            mine = rows[(rows >= lo) & (rows < hi)] - lo
            stats.tokens_recomputed = len(mine)
            stats.reused_tokens_recomputed = int(sb.reused[mine].sum())


def _rotate_all_layers(rotary, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """RoPE at ``positions`` for K of every layer at once: [L, T, H, D] -> [L, T, H, D]."""
    num_layers, t, h, d = k.shape
    flat = k.permute(1, 0, 2, 3).reshape(t, num_layers * h, d)
    return rotary.rotate_k(positions, flat).reshape(t, num_layers, h, d).permute(1, 0, 2, 3)
