"""Cold chunk pages for the loading benchmarks: page LMDB values out of the OS page cache.

``madvise(MADV_PAGEOUT)`` (Linux 5.4+) over a value's range in LMDB's memory map, as in a server
whose page cache lost them; ``mincore`` says how much stayed resident.
"""

from __future__ import annotations

import ctypes
import mmap

MADV_PAGEOUT = 21
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def page_range(tensor) -> tuple[int, int]:
    """(start, length) of the pages under ``tensor``'s bytes."""
    start = tensor.data_ptr() // PAGE * PAGE
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE) * PAGE
    return start, end - start


def resident(ranges) -> float:
    """Share of the ranges' pages in memory."""
    total = hit = 0
    for start, length in ranges:
        n = length // PAGE
        vec = (ctypes.c_ubyte * n)()
        if _libc.mincore(start, length, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        hit += sum(b & 1 for b in vec)
        total += n
    return hit / total if total else 0.0


def page_out(store, keys) -> float:
    """Page out the LMDB values of ``keys``; the share of their pages still resident after."""
    with store.reader() as reader:
        ranges = [page_range(chunk.kv) for k in keys if (chunk := reader.view(k)) is not None]
        for start, length in ranges:
            if _libc.madvise(start, length, MADV_PAGEOUT) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_PAGEOUT) failed")
        return resident(ranges)
