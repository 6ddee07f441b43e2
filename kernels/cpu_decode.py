"""Decode rows on the CPU through one C++ kernel call per layer: the ``cpu`` backend's decode.

The torch reference (:mod:`paged_decode`) attends each decode row with its own flash call. Here
every decode row of a step is attended by one call of ``torch.ops.blendkv_cpu.decode_attention``
(``kernels/cpu/decode_attention.cpp``, built for this machine on first use by
:mod:`blendkv.kernels.cpu_extension`): one task per (row, kv head) over torch's intra-op
threads, each reading its keys and values once through their pool slots for the query heads
that share them, softmax over exactly the row's keys.

    slots [R, L]: pool slots of row r's keys 0..lens[r]-1 (block table x block size + offset);
                  past ``lens[r]`` they are never read
    q [T, Hq, D] (rows[r] = the r-th decode row) x keys [S, Hkv, D] -> out [T, Hq, D]

Float32 and bfloat16 pools. :func:`dense_decode_attention` is the reference the tests hold the
kernel to (with a dense float64 oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blendkv.kernels.attention import AttentionMetadata
from blendkv.kernels.cpu_extension import load_ops


def dense_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """The kernel's reference, dense: ``q`` [R, Hkv, G, D]; ``keys``/``values`` [pool slots,
    Hkv, D] (one layer's pool); ``slots`` [R, L] int64; ``lens`` [R] real keys per row (>= 1)
    -> [R, Hkv, G, D]. ``window``: a row sees its last ``window`` keys; ``soft_cap``: scores
    ``cap * tanh(s / cap)``."""
    k = keys[slots]  # [R, L, Hkv, D]
    v = values[slots]
    scores = (q[:, None] * k[:, :, :, None, :]).sum(-1) * scale  # [R, L, Hkv, G]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    key_idx = torch.arange(slots.shape[1], device=slots.device)[None, :]
    visible = key_idx < lens[:, None]
    if window is not None:
        visible &= key_idx >= lens[:, None] - window
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    return (probs[..., None] * v[:, :, :, None, :]).sum(1)


@dataclass(frozen=True)
class DenseDecode:
    """A step's decode rows, attended together by :class:`DecodeKernel`."""

    rows: torch.Tensor  # [R] int64 token rows
    slots: torch.Tensor  # [R, L] int64, L = the longest context among them
    lens: torch.Tensor  # [R] int64


def dense_decode_layout(md: AttentionMetadata, seqs: list[int], block_size: int) -> DenseDecode:
    """The slots of every key of the decode sequences ``seqs``, from their block tables."""
    dev = md.positions.device
    idx = torch.tensor(seqs, dtype=torch.long, device=dev)
    longest = max(md.seq_lens_cpu[i] for i in seqs)
    num_blocks = -(-longest // block_size)
    table = md.block_table[idx, :num_blocks].long()  # zeros past a row's own blocks: never read
    offsets = torch.arange(block_size, device=dev)
    slots = (table[:, :, None] * block_size + offsets).reshape(len(seqs), -1)[:, :longest]
    rows = torch.tensor([md.query_start_loc_cpu[i] for i in seqs], dtype=torch.long, device=dev)
    return DenseDecode(rows, slots.contiguous(), md.seq_lens[idx].long().contiguous())


class DecodeKernel:
    """The C++ kernel. ``ops``: ``torch.ops.blendkv_cpu``; built and loaded here when None
    (raises :class:`~blendkv.kernels.cpu_extension.CPUKernelBuildError` when it cannot be)."""

    def __init__(self, ops=None) -> None:
        if ops is None:
            ops = load_ops()
        self.ops = ops

    def __call__(
        self, q, kv_cache, layout: DenseDecode, out, scale, window=None, soft_cap=None
    ) -> None:
        """``window``: each row reads its last ``window`` keys only (the slots before them, and
        so whole blocks outside the window, are never read); ``soft_cap``: capped scores."""
        _, _, _, num_kv_heads, head_dim = kv_cache.shape
        pool = kv_cache.view(2, -1, num_kv_heads, head_dim)
        q = q.contiguous()
        dst = out if out.is_contiguous() else torch.empty_like(q)
        self.ops.decode_attention(
            q,
            pool[0],
            pool[1],
            layout.rows,
            layout.slots,
            layout.lens,
            scale,
            dst,
            0 if window is None else int(window),
            0.0 if soft_cap is None else float(soft_cap),
        )
        if dst is not out:
            out[layout.rows] = dst[layout.rows]
