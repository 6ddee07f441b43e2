"""Torch attention backend: the plain-torch reference every other backend is tested against
(the forward goldens run it), and what runs on a CPU without a compiler.

Keys are gathered from the paged cache through the block table and attended with
``scaled_dot_product_attention`` under an explicit mask built from absolute positions. A
sequence whose query tokens are its whole context in order (a fresh prefill) is exactly the
upper-left causal case: SDPA builds the mask itself. On the CPU, where SDPA's flash kernel
returns its log-sum-exp, scattered rows go through :mod:`split_attention` and decode rows
through :mod:`paged_decode`, and a context held by one run of consecutive blocks (the block
manager places them so) is read as a slice of the pool, not gathered.

Each kind of rows is one overridable method (``_causal``, ``_rows``, ``_query_rows``,
``_decode_layout`` / ``_decode``): the ``cpu`` backend (:mod:`cpu_attention`) replaces them with
its C++ kernels where those apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from blendkv.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    StepLayoutMemo,
    split_by_kind,
)
from blendkv.kernels.attention_mass import attention_with_mass
from blendkv.kernels.batch_invariant import PerRowMemo
from blendkv.kernels.paged_decode import block_runs, decode_attention, decode_layout
from blendkv.kernels.split_attention import available as split_available
from blendkv.kernels.split_attention import build_row_groups, split_masked_attention
from blendkv.kernels.uploads import upload, upload_list


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


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Rows of one sequence at ``positions`` over its keys: one SDPA call under the position
    mask (devices without the CPU flash kernel; the CPU runs :mod:`split_attention`)."""
    mask = position_mask(positions, keys.shape[0])
    return _sdpa(q[None], keys[None], values[None], mask, scale)[0]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    query_scoring = "in_attention"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self._step_layouts = StepLayoutMemo()  # (metadata, pool blocks) -> _StepLayout
        self._per_row = PerRowMemo()  # deterministic mode: metadata -> its per-row metadata
        self._flash_cpu = split_available(self.device)  # split attention, decode in place
        self.prefers_block_runs = self._flash_cpu  # the CPU path reads runs as slices

    def step_layouts(self, md: AttentionMetadata) -> list:
        return self._step_layouts.layouts_for(md)

    # ---- the pool -----------------------------------------------------------------------
    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        write_kv_cache(kv_cache, k, v, slot_mapping)

    def read_kv(self, kv_cache, slot_mapping):
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        # index_select over 2-D rows: the fast CPU path (advanced indexing is several x slower).
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads * head_dim)
        k = flat[0].index_select(0, slot_mapping).view(-1, num_kv_heads, head_dim)
        v = flat[1].index_select(0, slot_mapping).view(-1, num_kv_heads, head_dim)
        return k, v

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
        positions_cpu = torch.cat(positions)
        return AttentionMetadata(
            positions=upload(positions_cpu, dev),
            slot_mapping=upload(torch.cat(slots), dev),
            query_start_loc=upload_list(query_start_loc, torch.int32, dev),
            seq_lens=upload_list(seq_lens, torch.int32, dev),
            block_table=upload(block_table, dev),
            block_size=block_size,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            is_contiguous_prefill=[True] * len(query_lens),
            positions_cpu=positions_cpu,
        )

    def dense_metadata(self, seq_lens):
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        dev = self.device
        positions_cpu = torch.cat([torch.arange(n) for n in seq_lens])
        return AttentionMetadata(
            positions=positions_cpu.to(dev),
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
            positions_cpu=positions_cpu,
        )

    # ---- attention ----------------------------------------------------------------------
    def forward(
        self,
        q,
        k,
        v,
        kv_cache,
        attn_metadata,
        scale,
        *,
        window=None,
        soft_cap=None,
        out=None,
        kv_written=False,
        scoring=None,
    ):
        md: AttentionMetadata | None = attn_metadata
        requests = scoring.requests if scoring is not None else {}
        wc = {} if window is None and soft_cap is None else {"window": window, "soft_cap": soft_cap}
        out = torch.empty_like(q) if out is None else out
        if kv_cache is None:
            self._causal_per_seq(q, k, v, md, scale, out, wc)
            return out
        if not kv_written:
            self.write_kv(kv_cache, k, v, md.slot_mapping)
        if self.deterministic and not requests:
            md = self._per_row.get(md)  # every row a decode row (kernels.batch_invariant)
        # (a query pass's metadata is only ever attended with its requests: one layout)
        layout = self._step_layouts.get(
            md, kv_cache.shape[1], lambda: self._build_layout(md, kv_cache.shape, q, requests)
        )
        for lo, hi in layout.fresh_ranges:
            # Fresh prefill: the new tokens are the whole context, upper-left causal is exact.
            self._causal(q[lo:hi], k[lo:hi], v[lo:hi], scale, out[lo:hi], **wc)
        self._attend_other_seqs(q, kv_cache, md, layout, requests, scale, out, wc)
        if layout.decode is not None and not wc and not self.deterministic:
            self._decode(q, kv_cache, layout.decode, out, scale)
        elif layout.decode is not None:
            self._decode_windowed(q, kv_cache, md, layout, out, scale, window, soft_cap)
        return out

    def _causal_per_seq(self, q, k, v, md: AttentionMetadata | None, scale, out, wc) -> None:
        """The pool-less pass: ``out`` = each sequence's causal attention over its own rows
        (``wc``: the layer's window / soft cap keywords, empty without)."""
        if md is None or md.num_seqs == 1:
            self._causal(q, k, v, scale, out, **wc)
            return
        starts = md.query_start_loc_cpu
        for lo, hi in zip(starts, starts[1:], strict=False):
            self._causal(q[lo:hi], k[lo:hi], v[lo:hi], scale, out[lo:hi], **wc)

    def _attend_other_seqs(
        self, q, kv_cache, md: AttentionMetadata, layout: _StepLayout, requests, scale, out, wc
    ) -> None:
        """``out`` at the rows of the sequences neither fresh nor decoding (chunked prefill,
        prefix hit, blended rows) over their context in the pool; the rows of a query pass's
        ``requests`` also add the mass they pay each key to their request's scores."""
        starts = md.query_start_loc_cpu
        # the query rows' scale is D ** -0.5 unless the layer has its own
        mass_kw = {"scale": scale, **wc} if wc or scale != q.shape[-1] ** -0.5 else {}
        others = zip(
            layout.other_seqs,
            layout.row_groups,
            layout.other_slots,
            layout.scored_from,
            strict=True,
        )
        for i, groups, first, mid in others:
            lo, hi = starts[i], starts[i + 1]
            if first is None:
                keys, values = gather_kv(kv_cache, md.block_table[i], md.seq_lens_cpu[i])
            else:  # the context is one run of consecutive blocks: a slice of the pool
                flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
                keys, values = flat[:, first : first + md.seq_lens_cpu[i]]
            if mid > lo:
                positions = md.positions[lo:mid]
                self._rows(q[lo:mid], keys, values, positions, scale, out[lo:mid], groups, **wc)
            if mid < hi:  # ProphetKV's query rows: their output and their score, one call
                request = requests[i]
                mass = self._query_rows(
                    q[mid:hi],
                    keys,
                    values,
                    md.positions[mid:hi],
                    request.visible_prefix,
                    out[mid:hi],
                    **mass_kw,
                )
                request.scores.add_(mass)

    # ---- one method per kind of rows (the cpu backend overrides them) -------------------
    # A window or soft cap comes as the ``window``/``soft_cap`` keywords, only when one is set
    # (the plain path stays as it is); here the dense oracle runs them.
    def _causal(self, q, k, v, scale, out, window=None, soft_cap=None) -> None:
        """``out`` = causal attention of one fresh sequence (positions 0..n-1)."""
        if window is None and soft_cap is None:
            out.copy_(dense_causal_attention(q, k, v, scale))
            return
        positions = torch.arange(q.shape[0], device=q.device)
        self._rows(q, k, v, positions, scale, out, None, window=window, soft_cap=soft_cap)

    def _rows_layout(self, positions: torch.Tensor, group: int, dtype: torch.dtype) -> Any:
        """What :meth:`_rows` reuses across a step's layers for rows at ``positions``."""
        return build_row_groups(positions, group, dtype) if self._flash_cpu else None

    def _rows(
        self, q, keys, values, positions, scale, out, layout, window=None, soft_cap=None
    ) -> None:
        """``out`` = rows of one sequence at ascending ``positions`` over ``keys``/``values``
        (its context, positions 0..S-1); ``layout``: :meth:`_rows_layout` of the positions."""
        if window is not None or soft_cap is not None:
            out[:], _ = attention_with_mass(
                q, keys, values, positions, scale=scale, window=window, soft_cap=soft_cap
            )
        elif layout is None:
            out.copy_(masked_attention(q, keys, values, positions, scale))
        else:
            out.copy_(split_masked_attention(q, keys, values, positions, scale, layout))

    def _query_rows(
        self,
        q,
        keys,
        values,
        positions,
        visible_prefix,
        out,
        scale=None,
        window=None,
        soft_cap=None,
    ) -> torch.Tensor:
        """Query rows' attention into ``out`` and the mass [S] float32 they pay each key
        (scale ``D ** -0.5`` unless given,
        :func:`~blendkv.kernels.attention_mass.attention_with_mass`)."""
        out[:], mass = attention_with_mass(
            q,
            keys,
            values,
            positions,
            visible_prefix,
            scale=scale,
            window=window,
            soft_cap=soft_cap,
        )
        return mass

    def _decode_layout(self, md: AttentionMetadata, seqs: list[int], cache_shape, q) -> Any:
        """What :meth:`_decode` reuses across a step's layers for the decode rows ``seqs``."""
        return decode_layout(md, seqs, cache_shape, self._flash_cpu)

    def _decode(self, q, kv_cache, layout, out, scale) -> None:
        """``out`` at the decode rows of ``layout`` (:meth:`_decode_layout`)."""
        decode_attention(q, kv_cache, layout, out, scale)

    def _decode_windowed(self, q, kv_cache, md, layout, out, scale, window, soft_cap) -> None:
        """The decode rows on a layer with a window or a soft cap: the dense oracle over each
        row's last ``window`` keys (the blocks before them are not read)."""
        for i in layout.decode_seqs:
            row, seq_len = md.query_start_loc_cpu[i], md.seq_lens_cpu[i]
            bs = kv_cache.shape[2]
            first = 0 if window is None else max(0, seq_len - window) // bs * bs
            keys, values = gather_kv(kv_cache, md.block_table[i, first // bs :], seq_len - first)
            position = md.positions[row : row + 1] - first
            out[row : row + 1], _ = attention_with_mass(
                q[row : row + 1],
                keys,
                values,
                position,
                scale=scale,
                window=window,
                soft_cap=soft_cap,
            )

    def _build_layout(
        self, md: AttentionMetadata, cache_shape: torch.Size, q, requests: dict
    ) -> _StepLayout:
        fresh, decode, other = split_by_kind(md)
        group = q.shape[1] // cache_shape[3]
        starts = md.query_start_loc_cpu
        # Rows from `scored_from` on are query rows scored in attention (the requests).
        scored_from = [requests[i].first_row if i in requests else starts[i + 1] for i in other]
        row_layouts = [
            self._rows_layout(md.positions[starts[i] : mid], group, q.dtype)
            if mid > starts[i]
            else None
            for i, mid in zip(other, scored_from, strict=True)
        ]
        slots = [None] * len(other)
        if self._flash_cpu:
            runs = [block_runs(md, i, cache_shape[2]) for i in other]
            slots = [r[0][0] if len(r) == 1 else None for r in runs]
        decode_rows = self._decode_layout(md, decode, cache_shape, q) if decode else None
        return _StepLayout(fresh, other, row_layouts, decode_rows, slots, scored_from, decode)


@dataclass(frozen=True)
class _StepLayout:
    """How one metadata object's sequences are attended (built once, used by every layer)."""

    fresh_ranges: list[tuple[int, int]]
    other_seqs: list[int]
    row_groups: list[Any]  # per other seq: its _rows_layout (None: masked SDPA, not the CPU)
    decode: Any  # _decode_layout of the decode rows, None without any
    # per other seq: its first pool slot when its context is one run of consecutive blocks
    # (read as a slice, not gathered; CPU), else None
    other_slots: list[int | None]
    # per other seq: the row where its query rows scored in attention begin (its end if none)
    scored_from: list[int]
    decode_seqs: list[int]  # the sequences of the decode rows
