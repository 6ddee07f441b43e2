"""Torch attention backend: the CPU path and the reference every other backend is tested against.

Keys are gathered from the paged cache through the block table and attended with
``scaled_dot_product_attention`` under an explicit mask built from absolute positions. The
shortcuts: a sequence whose query tokens are its whole context in order (a fresh prefill) is
exactly the upper-left causal case, so it skips the gather and lets SDPA build the mask itself;
and on the CPU a context held by one run of consecutive blocks (the block manager places them
so) is read as a slice of the pool, not gathered. Decode rows: :mod:`paged_decode`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blendkv.kernels import compiled_blend
from blendkv.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    StepPlanMemo,
    split_by_kind,
)
from blendkv.kernels.attention_mass import query_attention_mass, query_rows_attention
from blendkv.kernels.compiled_decode import CompiledDecode, DenseDecode, plan_dense_decode
from blendkv.kernels.compiled_prefill import CompiledPrefill
from blendkv.kernels.paged_decode import DecodePlan, block_runs, decode_attention, plan_decode
from blendkv.kernels.split_attention import RowGroup, plan_row_groups, split_masked_attention
from blendkv.kernels.split_attention import available as split_available


def write_kv_cache(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``k``/``v`` [num_tokens, kv_heads, head_dim] into their slots of the paged cache."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    # 2-D rows of heads*head_dim with contiguous sources: index_copy_'s fast path (the 3-D or
    # strided form is an order of magnitude slower on CPU).
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads * head_dim)
    width = num_kv_heads * head_dim
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype).reshape(-1, width).contiguous())
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype).reshape(-1, width).contiguous())


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first row, end row, first slot) of each run of consecutive ``slots`` [T]."""
    if len(slots) == 0:
        return []
    breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *breaks, len(slots)]
    firsts = slots[bounds[:-1]].tolist()
    return list(zip(bounds[:-1], bounds[1:], firsts, strict=True))


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """K and V of ``block_ids`` (any shape ``S``): [2, *S, block_size, kv_heads, head_dim].

    One ``index_select`` over 2-D rows of whole blocks: several times faster on CPU than
    advanced indexing of the 5-D pool.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat_ids = block_ids.reshape(-1).long()
    rows = kv_cache.view(2 * num_blocks, block_size * num_kv_heads * head_dim)
    picked = rows.index_select(0, torch.cat((flat_ids, flat_ids + num_blocks)))
    return picked.view(2, *block_ids.shape, block_size, num_kv_heads, head_dim)


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` keys and values of a sequence: [seq_len, kv_heads, head_dim] each."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks = -(-seq_len // block_size)
    blocks = gather_blocks(kv_cache, block_ids[:num_blocks])  # [2, nb, bs, H, D]
    blocks = blocks.reshape(2, num_blocks * block_size, num_kv_heads, head_dim)[:, :seq_len]
    return blocks[0], blocks[1]


def _sdpa(q, k, v, mask, scale, is_causal=False):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> [B, Lq, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence, queries and keys both at positions 0..n-1: plain causal attention."""
    causal = q.shape[0] > 1
    return _sdpa(q[None], k[None], v[None], None, scale, is_causal=causal)[0]


def position_mask(q_positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Boolean [Lq, seq_len]: query at position p sees keys at positions <= p."""
    key_positions = torch.arange(seq_len, device=q_positions.device)
    return key_positions[None, :] <= q_positions[:, None]


# masked_attention: rows in up to this many groups of at least this many rows each.
_MAX_ROW_GROUPS = 8
_MIN_GROUP_ROWS = 64


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Rows of one sequence at ascending (possibly scattered) ``positions`` over its keys.

    With an explicit mask SDPA computes every (row, key) pair, masked ones included. The rows
    are split into groups and each group only gets the keys up to its last row's position,
    which skips most of the masked triangle (measured 1.3-1.5x faster for 1K scattered rows
    over 6K keys on CPU). Needs ``positions`` ascending, as the runner lays rows out.
    """
    n = q.shape[0]
    num_groups = max(1, min(_MAX_ROW_GROUPS, n // _MIN_GROUP_ROWS))
    if num_groups == 1:
        mask = position_mask(positions, keys.shape[0])
        return _sdpa(q[None], keys[None], values[None], mask, scale)[0]
    bounds = [round(g * n / num_groups) for g in range(num_groups + 1)]
    last_positions = positions[[b - 1 for b in bounds[1:]]].tolist()
    out = torch.empty_like(q)
    for lo, hi, last in zip(bounds[:-1], bounds[1:], last_positions, strict=True):
        end = last + 1
        mask = position_mask(positions[lo:hi], end)
        out[lo:hi] = _sdpa(q[None, lo:hi], keys[None, :end], values[None, :end], mask, scale)[0]
    return out


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self._step_plans = StepPlanMemo()  # (metadata, pool blocks) -> _StepPlan
        self._split_rows = split_available(self.device)  # scattered rows: split attention
        self.prefers_block_runs = self._split_rows  # the CPU path reads runs as slices
        self.compiled_decode: CompiledDecode | None = None  # enable_compiled_decode()
        self.compiled_prefill: CompiledPrefill | None = None  # enable_compiled_prefill()

    def enable_compiled_decode(self) -> None:
        """Decode rows through one C++ kernel call per layer (:mod:`compiled_decode`): CPU,
        float32 or bfloat16 pools (the engine checks the dtype). Builds the kernel on first
        use; raises :class:`~blendkv.kernels.cpu_extension.CPUKernelBuildError` if it can't."""
        if self.device.type != "cpu":
            raise ValueError(f"compiled decode attention runs on the CPU, not {self.device}")
        self.compiled_decode = CompiledDecode()

    def enable_compiled_prefill(self) -> None:
        """Prefill rows (fresh, chunked, scattered) through one C++ kernel call per sequence
        and layer (:mod:`compiled_prefill`), and a blend's loaded chunk K/V rotated into the
        pool by one C++ call per chunk (:meth:`load_rotated_kv`): CPU, float32 or bfloat16 (the
        engine checks the dtype). Builds the kernels on first use; raises
        :class:`~blendkv.kernels.cpu_extension.CPUKernelBuildError` if it can't."""
        if self.device.type != "cpu":
            raise ValueError(f"compiled prefill attention runs on the CPU, not {self.device}")
        self.compiled_prefill = CompiledPrefill()

    def _causal(self, q, k, v, scale, out) -> None:
        """``out`` = causal attention of one fresh sequence (positions 0..n-1)."""
        if self.compiled_prefill is not None:
            self.compiled_prefill.causal(q, k, v, scale, out)
        else:
            out.copy_(dense_causal_attention(q, k, v, scale))

    def step_plans(self, md: AttentionMetadata) -> list:
        return self._step_plans.plans_for(md)

    # ---- the pool -----------------------------------------------------------------------
    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        write_kv_cache(kv_cache, k, v, slot_mapping)

    def load_rotated_kv(self, kv_caches, first_layer, kv, positions, slots, cos, sin) -> None:
        """On the CPU: K is rotated straight into the pool and V copied, with the prefill
        kernels on by one C++ pass (:mod:`compiled_blend`; 6,300 SmolLM2 tokens a layer in
        0.56 ms on one thread against 1.50 ms for the torch code below on two), else run by run of
        consecutive slots in torch (no rotated copy of K and no ``index_copy_``: 12.8 against
        26.5 ms for the reference for 30 layers x 600 tokens, one thread). Both write the
        reference's bits: each half of the rotation is its two products and one sum, rounded
        as it rounds them."""
        if self.device.type != "cpu" or kv.dtype != kv_caches[0].dtype:
            return super().load_rotated_kv(kv_caches, first_layer, kv, positions, slots, cos, sin)
        kernel = self.compiled_prefill
        args = (kv, kv_caches, first_layer, positions, slots, cos, sin)
        if kernel is not None and compiled_blend.rope_write(kernel.ops, *args):
            return
        num_kv_heads, head_dim = kv.shape[-2:]
        half = head_dim // 2
        c = cos.index_select(0, positions)[:, None, :].to(kv.dtype)  # [T, 1, D]
        s = sin.index_select(0, positions)[:, None, :].to(kv.dtype)
        for lo, hi, slot in slot_runs(slots):
            c1, c2, s1, s2 = (
                c[lo:hi, :, :half],
                c[lo:hi, :, half:],
                s[lo:hi, :, :half],
                s[lo:hi, :, half:],
            )
            for i in range(kv.shape[0]):
                pool = kv_caches[first_layer + i].view(2, -1, num_kv_heads, head_dim)
                dst = pool[:, slot : slot + hi - lo]
                k1, k2 = kv[i, 0, lo:hi, :, :half], kv[i, 0, lo:hi, :, half:]
                d1, d2 = dst[0, :, :, :half], dst[0, :, :, half:]
                torch.mul(k1, c1, out=d1).sub_(k2 * s1)  # k1 c - k2 s
                torch.mul(k2, c2, out=d2).add_(k1 * s2)  # k2 c + k1 s
                dst[1].copy_(kv[i, 1, lo:hi])

    def read_kv(self, kv_cache, slot_mapping):
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        # index_select over 2-D rows: the fast CPU path (advanced indexing is several x slower).
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads * head_dim)
        k = flat[0].index_select(0, slot_mapping).view(-1, num_kv_heads, head_dim)
        v = flat[1].index_select(0, slot_mapping).view(-1, num_kv_heads, head_dim)
        return k, v

    @property
    def fused_chunk_shift(self) -> bool:
        """Whether shift_kept_rows does the K/V correction (in C++: with the prefill kernels)."""
        return self.compiled_prefill is not None

    def shift_kept_rows(self, kv_cache, which, shrink, k, v, recomputed, kept, num_chunks, cos,
                        sin, attention_scaling) -> bool:  # fmt: skip
        """A blended layer's K/V correction in one C++ call (:mod:`compiled_blend`); False if it
        does not apply (the caller then runs the torch code)."""
        kernel = self.compiled_prefill
        return kernel is not None and compiled_blend.shift_kept_rows(
            kernel.ops, kv_cache, which, shrink, k, v, recomputed, kept, num_chunks, cos, sin,
            attention_scaling)  # fmt: skip

    scores_in_attention = True

    def add_query_mass(self, scores, q, q_positions, kv_cache, slots, visible_prefix=0) -> None:
        """``scores`` [S] float32 += the softmax attention ``q`` [Q, H, D] (RoPE applied, rows
        at ``q_positions``) pays each key of positions ``0..S-1``, read from ``kv_cache`` at
        ``slots`` [S] (the query rows' own K already written), summed over rows and heads.
        ``visible_prefix``: how many leading keys every row sees (spares their masking)."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        flat_k = kv_cache[0].view(num_blocks * block_size, num_kv_heads * head_dim)
        keys = flat_k.index_select(0, slots).view(-1, num_kv_heads, head_dim)  # K only
        key_positions = torch.arange(len(slots), device=slots.device)
        scores += query_attention_mass(q, keys, q_positions, key_positions, visible_prefix)

    def copy_blocks(self, kv_caches, copies) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for kv in kv_caches:
            kv[:, dst] = kv[:, src]

    # ---- metadata -----------------------------------------------------------------------
    def build_metadata(self, num_computed_tokens, query_lens, block_tables, block_size):
        positions, slots = [], []
        query_start_loc, seq_lens = [0], []
        for start, n, table in zip(num_computed_tokens, query_lens, block_tables, strict=True):
            pos = torch.arange(start, start + n, dtype=torch.long)
            blocks = torch.tensor(table, dtype=torch.long)
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
        max_blocks = max(len(t) for t in block_tables)
        block_table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
        for i, table in enumerate(block_tables):
            block_table[i, : len(table)] = torch.tensor(table)
        dev = self.device
        return AttentionMetadata(
            positions=torch.cat(positions).to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=block_table.to(dev),
            block_size=block_size,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            is_contiguous_prefill=[True] * len(query_lens),
        )

    def dense_metadata(self, seq_lens):
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        dev = self.device
        return AttentionMetadata(
            positions=torch.cat([torch.arange(n) for n in seq_lens]).to(dev),
            slot_mapping=torch.empty(0, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.empty(len(seq_lens), 0, dtype=torch.int32, device=dev),
            block_size=0,
            max_query_len=max(seq_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(seq_lens),
            is_contiguous_prefill=[True] * len(seq_lens),
        )

    # ---- attention ----------------------------------------------------------------------
    def forward(self, q, k, v, kv_cache, attn_metadata, scale):
        md: AttentionMetadata | None = attn_metadata
        if kv_cache is None:
            if (md is None or md.num_seqs == 1) and self.compiled_prefill is None:
                return dense_causal_attention(q, k, v, scale)
            out = torch.empty_like(q)
            starts = [0, q.shape[0]] if md is None else md.query_start_loc_cpu
            for lo, hi in zip(starts, starts[1:], strict=False):
                self._causal(q[lo:hi], k[lo:hi], v[lo:hi], scale, out[lo:hi])
            return out
        self.write_kv(kv_cache, k, v, md.slot_mapping)
        plan = self._step_plans.get(
            md, kv_cache.shape[1], lambda: self._build_plan(md, kv_cache.shape, q)
        )
        out = torch.empty_like(q)
        starts = md.query_start_loc_cpu
        for lo, hi in plan.fresh_ranges:
            # Fresh prefill: the new tokens are the whole context, upper-left causal is exact.
            self._causal(q[lo:hi], k[lo:hi], v[lo:hi], scale, out[lo:hi])
        others = zip(
            plan.other_seqs, plan.row_groups, plan.other_slots, plan.scored_from, strict=True
        )
        for i, groups, first, mid in others:
            lo, hi = starts[i], starts[i + 1]
            if first is None:
                keys, values = gather_kv(kv_cache, md.block_table[i], md.seq_lens_cpu[i])
            else:  # the context is one run of consecutive blocks: a slice of the pool
                flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
                keys, values = flat[:, first : first + md.seq_lens_cpu[i]]
            positions = md.positions[lo:mid]
            if mid > lo and self.compiled_prefill is not None:
                self.compiled_prefill(q[lo:mid], keys, values, positions, scale, out[lo:mid])
            elif mid > lo and groups is None:
                out[lo:mid] = masked_attention(q[lo:mid], keys, values, positions, scale)
            elif mid > lo:
                out[lo:mid] = split_masked_attention(
                    q[lo:mid], keys, values, positions, scale, groups
                )
            if mid < hi:  # ProphetKV's query rows: their output and their score, one call
                request, qp = md.query_mass[i], md.positions[mid:hi]
                args = (q[mid:hi], keys, values, qp, request.visible_prefix, out[mid:hi])
                mass = query_rows_attention(self.compiled_prefill, *args)
                request.scores.add_(mass)
        if plan.decode is not None:
            decode_attention(q, kv_cache, plan.decode, out, scale)
        if plan.dense_decode is not None:
            self.compiled_decode(q, kv_cache, plan.dense_decode, out, scale)
        return out

    def _build_plan(self, md: AttentionMetadata, cache_shape: torch.Size, q) -> _StepPlan:
        fresh, decode, other = split_by_kind(md)
        group = q.shape[1] // cache_shape[3]
        starts = md.query_start_loc_cpu
        # Rows from `scored_from` on are query rows scored in attention (query_mass).
        scored_from = [
            md.query_mass[i].first_row if md.query_mass and i in md.query_mass else starts[i + 1]
            for i in other
        ]
        row_groups = [
            plan_row_groups(md.positions[starts[i] : mid], group, q.dtype)
            if self._split_rows and self.compiled_prefill is None and mid > starts[i]
            else None
            for i, mid in zip(other, scored_from, strict=True)
        ]
        slots = [None] * len(other)
        if self._split_rows:
            runs = [block_runs(md, i, cache_shape[2]) for i in other]
            slots = [r[0][0] if len(r) == 1 else None for r in runs]
        decode_plan, dense = None, None
        if decode and self.compiled_decode is not None:
            dense = plan_dense_decode(md, decode, cache_shape[2])
        elif decode:
            decode_plan = plan_decode(md, decode, cache_shape, self._split_rows)
        return _StepPlan(fresh, other, row_groups, decode_plan, slots, scored_from, dense)


@dataclass(frozen=True)
class _StepPlan:
    """How one metadata object's sequences are attended (built once, used by every layer)."""

    fresh_ranges: list[tuple[int, int]]
    other_seqs: list[int]
    row_groups: list[list[RowGroup] | None]  # per other seq (None: masked SDPA, not the CPU)
    decode: DecodePlan | None
    # per other seq: its first pool slot when its context is one run of consecutive blocks
    # (read as a slice, not gathered; CPU), else None
    other_slots: list[int | None]
    # per other seq: the row where its query rows scored in attention begin (its end if none)
    scored_from: list[int]
    # decode rows when compiled decode is on: all of them in one kernel call per layer
    dense_decode: DenseDecode | None = None
