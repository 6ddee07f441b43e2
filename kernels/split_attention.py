"""Rows at scattered positions over their sequence's keys, the fast way on the CPU.

A masked SDPA call over CacheBlend's scattered rows computes and masks every (row, key) pair,
slower than a causal prefill over as many visible pairs (docs/benchmarks.md). Here rows go in
groups by ascending position: a group's keys before its first row's position ``p0`` (the
**prefix**) are attended without a mask, only the **band** from ``p0`` on with one, and the two
are merged through their log-sum-exps (SDPA's CPU flash kernel returns them). Query heads that
share a KV head are folded into its rows; a run of consecutive positions is its own unmasked
causal group. :func:`build_row_groups` depends on the positions only, so a step builds it once.
Equal to :func:`~blendkv.kernels.torch_attention.masked_attention` up to fp32 rounding; CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Row groups: more groups shrink the masked bands and add calls. A prefix shorter than
# _MIN_PREFIX keys is not worth a second call: the group runs masked over all its keys.
# _MIN_RUN consecutive positions make a causal group of their own.
_MAX_GROUPS = 8
_MIN_GROUP_ROWS = 64
_MIN_PREFIX = 64
_MIN_RUN = 32


def available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
    )


@dataclass(frozen=True)
class RowGroup:
    """Rows ``[lo, hi)``: keys ``[0, prefix)`` unmasked, then the band ``[prefix, end)``.

    ``mask`` is the band's additive mask over the folded rows ([(hi - lo) * G, end - prefix]),
    or None for a run: its rows sit at positions ``prefix .. end - 1``, a causal band."""

    lo: int
    hi: int
    prefix: int
    end: int
    mask: torch.Tensor | None


def build_row_groups(positions: torch.Tensor, group: int, dtype: torch.dtype) -> list[RowGroup]:
    """The groups for rows at ascending ``positions`` [n], ``group`` query heads per KV head."""
    pos = positions.tolist()
    n = len(pos)
    # Segments in row order: runs of >= _MIN_RUN consecutive positions, and what lies between.
    segments: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, n + 1):
        if i < n and pos[i] == pos[i - 1] + 1:
            continue
        if i - start >= _MIN_RUN:
            segments.append((start, i, True))
        elif segments and not segments[-1][2]:
            segments[-1] = (segments[-1][0], i, False)
        else:
            segments.append((start, i, False))
        start = i
    scattered = sum(hi - lo for lo, hi, run in segments if not run)
    budget = max(1, min(_MAX_GROUPS, scattered // _MIN_GROUP_ROWS))
    groups = []
    for lo, hi, run in segments:
        if run:
            groups.append(RowGroup(lo, hi, pos[lo], pos[hi - 1] + 1, None))
            continue
        parts = max(1, round(budget * (hi - lo) / scattered))
        bounds = [lo + round(g * (hi - lo) / parts) for g in range(parts + 1)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            first, end = pos[a], pos[b - 1] + 1
            # Every row sees keys [0, first]: the band starts at `first`, so no row is all masked.
            band_start = first if first >= _MIN_PREFIX else 0
            mask = _band_mask(positions[a:b], band_start, end, group, dtype)
            groups.append(RowGroup(a, b, band_start, end, mask))
    return groups


def split_masked_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    groups: list[RowGroup] | None = None,
) -> torch.Tensor:
    """``q`` [n, Hq, D] at ascending ``positions`` [n] over ``keys``/``values`` [T, Hkv, D].

    ``groups``: :func:`build_row_groups` of these positions (built here when None)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    if groups is None:
        groups = build_row_groups(positions, group, q.dtype)
    k = keys.transpose(0, 1)[None]  # [1, Hkv, T, D]
    v = values.transpose(0, 1)[None]
    out = torch.empty_like(q)
    for g in groups:
        rows = g.hi - g.lo
        # [rows, Hq, D] -> [1, Hkv, rows * G, D]: row r's heads of KV head h at rows r*G..r*G+G-1
        qg = q[g.lo : g.hi].view(rows, num_kv_heads, group, head_dim).transpose(0, 1)
        qg = qg.reshape(1, num_kv_heads, rows * group, head_dim)
        band_k, band_v = k[:, :, g.prefix : g.end], v[:, :, g.prefix : g.end]
        if g.mask is None:
            # Causal band, heads unfolded (the flash kernel's GQA) then folded like the prefix.
            qh = q[g.lo : g.hi].transpose(0, 1)[None]
            o, lse = flash_lse(qh, band_k, band_v, scale, None, True)
            o = o.view(1, num_kv_heads, group, rows, head_dim).transpose(2, 3)
            o = o.reshape(1, num_kv_heads, rows * group, head_dim)
            lse = lse.view(1, num_kv_heads, group, rows).transpose(2, 3).reshape(o.shape[:3])
        else:
            o, lse = flash_lse(qg, band_k, band_v, scale, g.mask)
        if g.prefix:
            o1, lse1 = flash_lse(qg, k[:, :, : g.prefix], v[:, :, : g.prefix], scale, None)
            both = torch.logaddexp(lse, lse1)
            o = o * torch.exp(lse - both)[..., None] + o1 * torch.exp(lse1 - both)[..., None]
        out[g.lo : g.hi] = (
            o[0]
            .view(num_kv_heads, rows, group, head_dim)
            .transpose(0, 1)
            .reshape(rows, num_heads, head_dim)
        )
    return out


def _band_mask(positions, start, end, group, dtype) -> torch.Tensor:
    """Additive [rows * G, end - start]: row r (repeated G times) sees keys at <= positions[r]."""
    keys = torch.arange(start, end, device=positions.device)
    visible = (keys[None, :] <= positions[:, None]).repeat_interleave(group, dim=0)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


def flash_lse(q, k, v, scale, mask, causal=False):
    """SDPA's CPU flash kernel: output [1, H, L, D] and its log-sum-exp [1, H, L] (fp32)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )[:2]
    return out, lse
