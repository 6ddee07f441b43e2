"""Triton attention backend: paged attention kernels for a GPU (and, slowly, the CPU under
``TRITON_INTERPRET=1``, which is how the tests check it against the torch backend).

Per layer, with a KV pool::

    write_kv (kv_write kernel)  ->  rows of the step split by kind, each kind in one launch:
        fresh prefill   (query = whole context, in order)   dense causal: xFormers or SDPA
        decode          (one row, contiguous)                decode_attention (flash-decoding)
        everything else (chunked prefill, prefix hit,        prefill_attention (rows at
                         CacheBlend's scattered rows)         arbitrary positions)

Which sequence goes where, and the tile tables of ``prefill_attention``, depend only on the
metadata, so they are built once per metadata object from its Python mirrors (no device sync)
and memoised for the other layers of the step (:class:`_StepLayout`). Triton and xFormers are
imported when the backend is built, never at module import.

A layer with a sliding window or a logit soft cap sends its fresh prefills through
``prefill_attention`` too (it takes both; SDPA and xFormers' causal masks do not), its decode
rows through ``decode_attention`` with the window (blocks before it are not read); a pass
without a pool runs the torch reference's dense path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blendkv.config import KernelConfig
from blendkv.kernels.attention import AttentionMetadata, StepLayoutMemo, split_by_kind
from blendkv.kernels.batch_invariant import FIXED_NUM_SPLITS
from blendkv.kernels.torch_attention import TorchAttentionBackend, dense_causal_attention

if TYPE_CHECKING:  # (the triton package imports Triton)
    from blendkv.kernels.triton.prefill_tiles import PrefillTiles

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _StepLayout:
    """How one metadata object's rows are dispatched (host-built, device index tensors)."""

    fresh_ranges: list[tuple[int, int]]  # [lo, hi) rows of fresh prefills
    decode_seq_ids: torch.Tensor  # [num_decode] int32
    tile_seq_ids: torch.Tensor  # [num_tiles] int32
    tile_starts: torch.Tensor  # [num_tiles] int32
    block_q: int
    num_splits: int  # decode key splits
    prefill_splits: int = 1  # key parts per prefill tile (few tiles over long keys)
    tiles: PrefillTiles | None = None  # the prefill kernel's (block_q came from its block_m)


class TritonAttentionBackend(TorchAttentionBackend):
    """Torch backend's pool handling and metadata, Triton kernels for writes and attention."""

    name = "triton"
    # Decode reads seq_lens on the device and sizes its grid from the Python mirrors; the layout
    # of a metadata object is built by its first forward, which DecodeGraphs runs before capture.
    supports_cuda_graphs = True
    # Triton's CPU interpreter keeps launch state in globals: one launching thread at a time.
    thread_safe = False

    def __init__(
        self, device: torch.device | str = "cuda", kernels: KernelConfig | None = None
    ) -> None:
        super().__init__(device)
        try:
            from blendkv.kernels import triton as ops
        except ImportError as e:
            raise ImportError(
                f"the triton attention backend needs the `triton` package ({e}); install it "
                "(pip install 'blendkv[gpu]') or use --attention-backend torch"
            ) from e
        self._ops = ops
        self._layouts = StepLayoutMemo()  # (metadata, num_heads / num_kv_heads) -> _StepLayout
        self._xformers_checked = False
        self._kernel_ok: dict[str, bool] = {}  # query_mass: ran on first use (else torch)
        self._xformers_attention = None
        self._programs: int | None = None  # prefill_num_splits' target (_target_programs)
        # Key splits and the prefill kernel's tiles (tuned table, defaults, another GPU's).
        self.kernels = kernels or KernelConfig()
        self._tiles: dict = {}  # (group, head_dim, dtype) -> PrefillTiles

    def step_layouts(self, md: AttentionMetadata) -> list:
        return [*super().step_layouts(md), *self._layouts.layouts_for(md)]

    # ---- the pool -----------------------------------------------------------------------
    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        self._ops.write_kv(kv_cache, k, v, slot_mapping)

    def add_query_mass(
        self,
        scores,
        q,
        q_positions,
        kv_cache,
        slots,
        visible_prefix=0,
        *,
        scale=None,
        window=None,
        soft_cap=None,
        lse=None,
        key_count=None,
    ) -> None:
        """Two launches reading the keys in place, one given attention's ``lse``
        (:mod:`blendkv.kernels.triton.query_mass`)."""
        from blendkv.kernels.triton.query_mass import add_query_mass

        layer = {"scale": scale, "window": window, "soft_cap": soft_cap}
        args = (scores, q, q_positions, kv_cache, slots)
        programs = {"target_programs": self._target_programs()}
        given = {"lse": lse, "key_count": key_count}
        kernel = lambda *a: add_query_mass(*a, **layer, **programs, **given)  # noqa: E731
        if self._first_use("query_mass", kernel, *args):
            return
        if self._kernel_ok["query_mass"]:
            kernel(*args)
        else:
            super().add_query_mass(*args, visible_prefix, **layer)

    # Its forward leaves the rows' log-sum-exp (from the prefill kernel: every row of such a
    # step goes there) and the pass scores in kernels.
    query_scoring = "from_lse"

    def _first_use(self, name: str, kernel, *args) -> bool:
        """:func:`first_use` of ``kernel`` in this backend's record."""
        return first_use(self._kernel_ok, name, kernel, *args)

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
        windowed = window is not None or soft_cap is not None
        if kv_cache is None:
            return self._attend_without_pool(q, k, v, md, scale, window, soft_cap, out)
        if not kv_written:
            self.write_kv(kv_cache, k, v, md.slot_mapping)
        lse = scoring.lse_out if scoring is not None else None  # every row to the prefill kernel
        if self.deterministic and lse is None:
            md = self._per_row.get(md)  # every row a decode row (kernels.batch_invariant)
        layout = self._layout(
            md,
            q.shape[1] // kv_cache.shape[3],
            windowed or lse is not None,
            kv_cache.shape[3],
            q.shape[2],
            kv_cache.dtype,
            lse is not None,
        )
        if layout.fresh_ranges == [(0, md.num_tokens)] and self._xformers() is None:
            # one fresh prefill and nothing else (a plain prompt): SDPA's output as is
            return _into(out, dense_causal_attention(q, k, v, scale))
        out = torch.empty_like(q) if out is None else out
        if layout.fresh_ranges:
            self._dense_prefill(q, k, v, layout.fresh_ranges, out, scale)
        self._paged_attention(out, q, kv_cache, md, layout, scale, window, soft_cap, lse)
        return out

    def _attend_without_pool(self, q, k, v, md, scale, window, soft_cap, out):
        """The pool-less pass (each sequence over its own rows): the dense torch reference
        with a window or a soft cap, else dense causal attention per sequence."""
        if window is not None or soft_cap is not None:
            return super().forward(
                q, k, v, None, md, scale, window=window, soft_cap=soft_cap, out=out
            )
        if md is None or md.num_seqs == 1:
            return _into(out, dense_causal_attention(q, k, v, scale))
        out = torch.empty_like(q) if out is None else out
        starts = md.query_start_loc_cpu
        self._dense_prefill(q, k, v, list(zip(starts, starts[1:], strict=False)), out, scale)
        return out

    def _paged_attention(
        self,
        out,
        q,
        kv_cache,
        md: AttentionMetadata,
        layout: _StepLayout,
        scale,
        window,
        soft_cap,
        lse,
    ) -> None:
        """``out`` at the rows that read the pool, as ``layout`` dispatches them: the decode
        rows (flash-decoding), then every other row by tiles (``lse``, if given, gets their
        log-sum-exp)."""
        self._ops.decode_attention(
            out,
            q,
            kv_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            layout.decode_seq_ids,
            scale,
            layout.num_splits,
            window,
            soft_cap,
        )
        self._ops.prefill_attention(
            out,
            q,
            kv_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            md.positions,
            layout.tile_seq_ids,
            layout.tile_starts,
            layout.block_q,
            scale,
            window,
            soft_cap,
            layout.prefill_splits,
            layout.tiles,
            lse,
        )

    # ---- per-step layout ------------------------------------------------------------------
    def _layout(
        self,
        md: AttentionMetadata,
        group: int,
        windowed: bool = False,
        num_kv_heads: int = 1,
        head_dim: int = 0,
        dtype: torch.dtype | None = None,
        all_tiles: bool = False,
    ) -> _StepLayout:
        """``windowed``: for a layer with a window or a soft cap (fresh prefills are tiles);
        ``head_dim`` / ``dtype`` (of the K/V pool) pick the prefill kernel's tuned tiles;
        ``all_tiles``: decode rows too (the step wants every row's log-sum-exp)."""
        tiles = self._prefill_tiles(group, head_dim, dtype)
        key = (group, windowed, num_kv_heads, tiles, all_tiles)
        build = lambda: self._build_layout(  # noqa: E731
            md, group, windowed, num_kv_heads, tiles, all_tiles
        )
        return self._layouts.get(md, key, build)

    def _prefill_tiles(self, group: int, head_dim: int, dtype: torch.dtype | None):
        """Memoised per shape: the lookup queries the device's properties, too slow to repeat
        at every layer."""
        from blendkv.kernels.triton.prefill_tiles import DEFAULT_TILES, tuned_tiles

        if self.kernels.prefill_tiles == "default" or dtype is None:
            return DEFAULT_TILES
        key = (group, head_dim, dtype)
        if key not in self._tiles:
            capability = self.kernels.tiles_capability
            self._tiles[key] = tuned_tiles(self.device, group, head_dim, dtype, capability)
        return self._tiles[key]

    def _build_layout(
        self,
        md: AttentionMetadata,
        group: int,
        windowed: bool,
        num_kv_heads: int = 1,
        tiles=None,
        all_tiles: bool = False,
    ) -> _StepLayout:
        from blendkv.kernels.triton.decode_attention import default_num_splits
        from blendkv.kernels.triton.prefill_tiles import (
            DEFAULT_TILES,
            block_q_for,
            build_tiles,
            prefill_num_splits,
        )

        tiles = tiles or DEFAULT_TILES

        starts = md.query_start_loc_cpu
        fresh, decode, other = split_by_kind(md)
        if windowed:  # fresh prefills go through prefill_attention, which takes both
            seq_of = {starts[i]: i for i in range(md.num_seqs) if starts[i + 1] > starts[i]}
            other = sorted([*other, *(seq_of[lo] for lo, _ in fresh)])
            fresh = []
        if all_tiles:
            other, decode = sorted([*other, *decode]), []
        block_q = block_q_for(group, tiles.block_m)
        tile_seq_ids, tile_starts = build_tiles(starts, other, block_q, md.positions.device)
        max_decode_len = max((md.seq_lens_cpu[i] for i in decode), default=1)
        # deterministic: a split that depends on the row alone, not on the step's longest row
        splits = FIXED_NUM_SPLITS if self.deterministic else default_num_splits(max_decode_len)
        prefill_splits = 1  # deterministic: no split that depends on the step's other rows
        if not self.deterministic:
            max_keys = max((md.seq_lens_cpu[i] for i in other), default=0)
            prefill_splits = prefill_num_splits(
                tile_seq_ids.numel(), num_kv_heads, max_keys, self._target_programs()
            )
        return _StepLayout(
            fresh_ranges=fresh,
            decode_seq_ids=_index_tensor(decode, md.positions.device),
            tile_seq_ids=tile_seq_ids,
            tile_starts=tile_starts,
            block_q=block_q,
            num_splits=splits,
            prefill_splits=prefill_splits,
            tiles=tiles,
        )

    def _target_programs(self) -> int:
        """Programs that fill the device about twice (the CPU interpreter: as an H100); 0 (no
        split) with ``KernelConfig.prefill_split_keys`` off."""
        if not self.kernels.prefill_split_keys:
            return 0
        if self._programs is None:
            sms = 132
            if self.device.type == "cuda":
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._programs = 2 * sms
        return self._programs

    # ---- dense causal prefill -----------------------------------------------------------
    def _dense_prefill(self, q, k, v, ranges, out, scale) -> None:
        """Causal attention of each ``[lo, hi)`` row range over its own rows (positions 0..n-1):
        one xFormers block-diagonal call when its CUDA kernels work, else SDPA per range."""
        xformers_attention = self._xformers()
        if xformers_attention is not None:
            xformers_attention(q, k, v, ranges, out, scale)
            return
        for lo, hi in ranges:
            out[lo:hi] = dense_causal_attention(q[lo:hi], k[lo:hi], v[lo:hi], scale)

    def _xformers(self):
        if not self._xformers_checked:
            self._xformers_checked = True
            self._xformers_attention, reason = _load_xformers(self.device)
            if self._xformers_attention is None:
                logger.info("triton backend: dense prefill uses torch SDPA (%s)", reason)
        return self._xformers_attention


def first_use(kernel_ok: dict[str, bool], name: str, kernel, *args) -> bool:
    """Run ``kernel`` the first time it is needed, catching a failure to compile or launch
    (logged; ``kernel_ok[name]`` False: the torch code takes over for good). True if it ran now."""
    if name in kernel_ok:
        return False
    try:
        kernel(*args)
    except Exception as e:
        logger.warning(
            "the Triton %s kernel failed (%s: %s); blending uses torch ops for it",
            name,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        kernel_ok[name] = False
        return False
    kernel_ok[name] = True
    return True


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into ``out`` when one is given."""
    return result if out is None else out.copy_(result)


def _index_tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int32 device tensor. A run of consecutive ids (every sequence of a
    decode-only step) is made by ``arange`` on the device: no host-to-device copy, which a CUDA
    graph capture would refuse."""
    if not ids:
        return torch.empty(0, dtype=torch.int32, device=device)
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return torch.arange(ids[0], ids[0] + len(ids), dtype=torch.int32, device=device)
    return torch.tensor(ids, dtype=torch.int32, device=device)


def _load_xformers(device: torch.device):
    """(attention function, None) when xFormers' CUDA attention runs here, else (None, reason)."""
    if device.type != "cuda":
        return None, f"xFormers needs CUDA, device is {device.type}"
    try:
        import xformers.ops as xops
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask

        probe = torch.zeros(1, 2, 1, 64, dtype=torch.float16, device=device)
        xops.memory_efficient_attention(probe, probe, probe, attn_bias=None)
    except Exception as e:  # noqa: BLE001 - any failure means "use SDPA", with the reason logged
        return None, f"xFormers unavailable: {type(e).__name__}: {e}"

    def attention(q, k, v, ranges, out, scale) -> None:
        index = torch.cat([torch.arange(lo, hi, device=q.device) for lo, hi in ranges])
        bias = BlockDiagonalCausalMask.from_seqlens([hi - lo for lo, hi in ranges])
        qs, ks, vs = q[index][None], k[index][None], v[index][None]
        if qs.shape[2] != ks.shape[2]:  # GQA: xFormers wants [B, M, G, H, K] or expanded heads
            group = qs.shape[2] // ks.shape[2]
            ks = ks.repeat_interleave(group, dim=2)
            vs = vs.repeat_interleave(group, dim=2)
        out[index] = xops.memory_efficient_attention(qs, ks, vs, attn_bias=bias, scale=scale)[0]

    return attention, None
