"""The ``cpu`` attention backend: the torch reference with the C++ kernels in its place where
they apply (``EngineConfig.attention_backend="cpu"``, the default on the CPU).

- decode rows: one :mod:`cpu_decode` call per layer for all of a step's decode rows;
- prefill rows (fresh, chunked, scattered, ProphetKV's query rows with their mass): one
  :mod:`cpu_prefill` call per sequence and layer, on CPUs with AVX-512 (on others SDPA's
  flash kernel, the reference, measured faster: ``docs/benchmarks.md``);
- (a blend's loaded chunk rotated into the pool and its K/V correction are not attention: their
  C++ kernels are :mod:`cpu_blend`'s, on this backend's ``ops``).

The kernels take float32 and bfloat16 on contiguous tensors. Where one does not apply (another
dtype, a layout it does not take, no compiler to build it with) that op runs the reference
(:class:`~blendkv.kernels.torch_attention.TorchAttentionBackend`), logged once per backend.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from blendkv.kernels import cpu_extension
from blendkv.kernels.attention import AttentionMetadata
from blendkv.kernels.cpu_decode import DecodeKernel, DenseDecode, dense_decode_layout
from blendkv.kernels.cpu_prefill import RowsKernel
from blendkv.kernels.torch_attention import TorchAttentionBackend

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def rows_kernel_wins() -> bool:
    """Whether the C++ prefill kernel beats SDPA's flash kernel on this CPU: on AVX-512 CPUs,
    not on AVX2 ones (docs/benchmarks.md)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class CpuAttentionBackend(TorchAttentionBackend):
    """``prefill_kernel``: whether prefill rows use the C++ kernel (None: on where it wins,
    :func:`rows_kernel_wins`); tests pass True to hold the kernel to the reference anywhere.
    Builds the kernels when made (cached after the first time)."""

    name = "cpu"

    def __init__(
        self, device: torch.device | str = "cpu", prefill_kernel: bool | None = None
    ) -> None:
        super().__init__(device)
        if self.device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, not {self.device}")
        self._logged: set[str] = set()
        try:
            ops = cpu_extension.load_ops()
        except cpu_extension.CPUKernelBuildError as exc:
            logger.warning("the C++ CPU kernels are unavailable, attention runs torch: %s", exc)
            ops = None
        self.ops = ops
        self.decode_kernel = None if ops is None else DecodeKernel(ops)
        wins = rows_kernel_wins() if prefill_kernel is None else prefill_kernel
        self.rows_kernel = None if ops is None or not wins else RowsKernel(ops)
        if ops is not None and not wins:
            logger.info(
                "prefill rows run SDPA's flash kernel (the reference): on this CPU (%s) it "
                "beats the C++ prefill kernel",
                torch.backends.cpu.get_cpu_capability(),
            )

    def _takes(self, kernel: Any, what: str, dtype: torch.dtype) -> bool:
        """Whether ``kernel`` (None: off) runs for ``dtype``; logs the first fallback."""
        if kernel is not None and dtype in KERNEL_DTYPES:
            return True
        if kernel is not None and what not in self._logged:
            self._logged.add(what)
            logger.info(
                "the C++ %s kernel takes float32 or bfloat16, not %s: torch runs", what, dtype
            )
        return False

    # ---- attention ----------------------------------------------------------------------
    def _causal(self, q, k, v, scale, out, **wc) -> None:
        if self._takes(self.rows_kernel, "prefill", q.dtype):
            self.rows_kernel.causal(q, k, v, scale, out, **wc)
        else:
            super()._causal(q, k, v, scale, out, **wc)

    def _rows_layout(self, positions, group, dtype) -> Any:
        if self._takes(self.rows_kernel, "prefill", dtype):
            return None  # the kernel needs no layout
        return super()._rows_layout(positions, group, dtype)

    def _rows(self, q, keys, values, positions, scale, out, layout, **wc) -> None:
        if self._takes(self.rows_kernel, "prefill", q.dtype):
            self.rows_kernel(q, keys, values, positions, scale, out, **wc)
        else:
            super()._rows(q, keys, values, positions, scale, out, layout, **wc)

    def _query_rows(
        self, q, keys, values, positions, visible_prefix, out, scale=None, **wc
    ) -> torch.Tensor:
        if not self._takes(self.rows_kernel, "prefill", q.dtype):
            return super()._query_rows(
                q, keys, values, positions, visible_prefix, out, scale=scale, **wc
            )
        mass = torch.zeros(keys.shape[0], dtype=torch.float32, device=keys.device)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        self.rows_kernel(q, keys, values, positions, scale, out, mass, **wc)
        return mass

    def _decode_layout(self, md: AttentionMetadata, seqs, cache_shape, q) -> Any:
        if self._takes(self.decode_kernel, "decode", q.dtype):
            return dense_decode_layout(md, seqs, cache_shape[2])
        return super()._decode_layout(md, seqs, cache_shape, q)

    def _decode(self, q, kv_cache, layout, out, scale) -> None:
        if isinstance(layout, DenseDecode):
            self.decode_kernel(q, kv_cache, layout, out, scale)
        else:
            super()._decode(q, kv_cache, layout, out, scale)

    def _decode_windowed(self, q, kv_cache, md, layout, out, scale, window, soft_cap) -> None:
        if isinstance(layout.decode, DenseDecode):
            self.decode_kernel(q, kv_cache, layout.decode, out, scale, window, soft_cap)
        else:
            super()._decode_windowed(q, kv_cache, md, layout, out, scale, window, soft_cap)
