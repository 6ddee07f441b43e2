"""Repairing the reused rows that are not recomputed: a per-chunk mean shift of K and/or V.

At a layer past the selection, the recomputed reused rows show how far this request's context
moves a chunk's K/V away from the stored one. The rows not recomputed get the same move on
average: for each chunk and KV head, the mean of (fresh - reused) over the chunk's recomputed
rows, shrunk with a pseudo-count ``shrink`` towards a prior when only ``n`` of its rows were
recomputed: ``(sum + shrink * prior) / (n + shrink)``. The prior is the mean over all the
sequence's ``N`` recomputed rows, itself shrunk the same way (``sum_all / (N + shrink)``;
``pooled``: every chunk moves alike in part, and a chunk with few recomputed rows borrows the
others'), or zero (``n / (n + shrink)`` of the chunk's own mean).
It costs one read and one write of the kept rows' K/V per layer, no attention.

K is shifted before RoPE (a mean over rows at different positions means nothing after it):
reused K is read back from the pool with the rotation undone, the shift is rotated to each
kept row's own position and added (RoPE is linear).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from blendkv.layers.rotary import rotate_half


def chunk_mean_shift(
    delta: torch.Tensor, chunk_ids: torch.Tensor, num_chunks: int, shrink: float, pooled: bool
) -> torch.Tensor:
    """delta [N, H, D] (fresh - reused of recomputed rows), chunk_ids [N] ->
    [num_chunks, H, D]: ``(sum + shrink * prior) / (n + shrink)`` per chunk, the prior the sum
    of all N rows over ``N + shrink`` (``pooled``) or 0 (then 0 for chunks without rows)."""
    sums_counts = _sums_index_add if delta.device.type == "cpu" else _sums_one_hot
    sums, counts = sums_counts(delta.float(), chunk_ids, num_chunks)
    weight = 1.0 / (counts + shrink).clamp_min(1e-12)  # mean (sum / n) times n / (n + shrink)
    if pooled and len(delta):
        # the chunks' sums added in chunk order (cumsum is sequential), as the kernels add them
        prior = sums.cumsum(0)[-1] / (counts.sum() + shrink)
        sums = sums + prior * shrink
    return sums * weight[:, None, None]


def _sums_index_add(delta, chunk_ids, num_chunks):
    """Per-chunk sums and row counts: the CPU path (sequential adds)."""
    sums = torch.zeros((num_chunks, *delta.shape[1:]), dtype=torch.float32)
    sums.index_add_(0, chunk_ids, delta)
    return sums, torch.bincount(chunk_ids, minlength=num_chunks).float()


def _sums_one_hot(delta, chunk_ids, num_chunks):
    """The same as a one-hot matmul: index_add_ adds with atomics on CUDA (the order of the sum,
    hence its bits, varies from run to run) and bincount syncs with the host; a matmul does
    neither."""
    chunks = torch.arange(num_chunks, device=delta.device)
    one_hot = (chunk_ids[None, :] == chunks[:, None]).float()  # [chunks, N]
    sums = (one_hot @ delta.flatten(1)).view(num_chunks, *delta.shape[1:])
    return sums, one_hot.sum(dim=1)


KEPT_PER_PART = 64  # kept rows one program of the shift kernel moves (<= 64 programs a chunk)


def shift_parts(kept_segments: list[int]) -> int:
    """Programs per (chunk, KV head): enough that none shifts more than ``KEPT_PER_PART`` of
    the chunk's kept rows (host-known sizes, no sync)."""
    most = max((b - a for a, b in zip(kept_segments, kept_segments[1:], strict=False)), default=0)
    return max(1, min(64, -(-most // KEPT_PER_PART)))


class Rows(NamedTuple):
    """Some reused rows of one sequence: where they sit and which chunk they belong to."""

    positions: torch.Tensor  # [N] absolute positions
    slots: torch.Tensor  # [N] KV-pool slots
    chunk_ids: torch.Tensor  # [N] index of the chunk in the prompt
    rows: torch.Tensor | None = None  # [N] (recomputed rows) their index among the layer's rows
    # (for a backend that shifts in kernels) int32 [chunks + 1]: chunk c's rows are
    # segments[c] .. segments[c + 1] (rows in position order, chunks too)
    segments: torch.Tensor | None = None
    parts: int = 1  # (kept rows, with segments) programs that share a chunk's rows


def correct_kept_rows(
    kernels,
    rotary,
    kv_cache: torch.Tensor,
    which: str,
    shrink: float,
    pooled: bool,
    recomputed: Rows,
    k: torch.Tensor,
    v: torch.Tensor,
    kept: Rows,
    num_chunks: int,
) -> None:
    """Shift the ``kept`` rows' K and/or V (``which``: ``k``, ``v`` or ``kv``) in ``kv_cache``
    by :func:`chunk_mean_shift` (``shrink``, ``pooled``).

    ``k`` (pre-RoPE) / ``v`` [T, Hkv, D]: the layer's fresh rows; ``recomputed.rows`` are the
    recomputed ones among them, whose slots still hold the reused K/V (call this before the
    layer's attention writes them). With ``recomputed.segments`` (and ``kept.segments``, which
    the Triton kernel needs) ``kernels`` (:class:`~blendkv.kernels.blend_kernels.BlendKernels`)
    do it all (:mod:`blendkv.kernels.triton.chunk_shift`: one launch;
    ``kernels/cpu/chunk_shift.cpp``); the torch code here is their reference.
    """
    if len(recomputed.slots) == 0 or len(kept.slots) == 0:
        return
    if recomputed.segments is not None:
        cos, sin = rotary.tables(kv_cache.device)
        if kernels.shift_kept_rows(
            kv_cache,
            which,
            shrink,
            pooled,
            k,
            v,
            recomputed,
            kept,
            num_chunks,
            cos,
            sin,
            rotary.attention_scaling,
        ):
            return
    if "v" in which:
        old_v = _read(kv_cache, 1, recomputed.slots)
        delta = v[recomputed.rows].float() - old_v.float()
        shift = chunk_mean_shift(delta, recomputed.chunk_ids, num_chunks, shrink, pooled)
        cur_v = _read(kv_cache, 1, kept.slots)
        _write(kv_cache, 1, _per_row(shift, kept.chunk_ids).add_(cur_v), kept.slots)
    if "k" in which:
        old_k = _read(kv_cache, 0, recomputed.slots)
        delta = k[recomputed.rows].float() - rotary.unrotate_k(recomputed.positions, old_k.float())
        shift = chunk_mean_shift(delta, recomputed.chunk_ids, num_chunks, shrink, pooled)
        # RoPE of the per-chunk shift at each kept row's position, rotate_half taken on the
        # [chunks, H, D] shift (exact: it permutes and negates); cos/sin of the kept positions
        # are gathered once per step (the rotary memo; ``kept`` is the same tensor every layer).
        cos, sin = rotary.cos_sin(kept.positions, torch.float32)
        moved = _per_row(shift, kept.chunk_ids).mul_(cos)
        moved.addcmul_(_per_row(rotate_half(shift), kept.chunk_ids), sin)
        _write(kv_cache, 0, moved.add_(_read(kv_cache, 0, kept.slots)), kept.slots)


def _read(kv_cache: torch.Tensor, half: int, slots: torch.Tensor) -> torch.Tensor:
    """K (``half`` 0) or V (1) of ``slots`` [N] -> [N, Hkv, D] (a copy): only the half the
    correction shifts is read and written back (the other is ~half the pool's traffic)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache[half].view(num_blocks * block_size, num_kv_heads * head_dim)
    return flat.index_select(0, slots).view(-1, num_kv_heads, head_dim)


def _write(kv_cache: torch.Tensor, half: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache[half].view(num_blocks * block_size, num_kv_heads * head_dim)
    flat.index_copy_(0, slots, rows.to(kv_cache.dtype).reshape(len(slots), -1).contiguous())


def _per_row(shift: torch.Tensor, chunk_ids: torch.Tensor) -> torch.Tensor:
    """[chunks, H, D] -> [N, H, D], row i = ``shift[chunk_ids[i]]`` (a new tensor): index_select
    over 2-D rows, the fast CPU path."""
    return shift.reshape(shift.shape[0], -1).index_select(0, chunk_ids).view(-1, *shift.shape[1:])
