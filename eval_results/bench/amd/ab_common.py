"""What the one-off MuSiQue A/B scripts next to this file share: their command line, the engine
(``bench_blend.musique_setup``: float32, no prefix cache, 8K context) and the blended prompts,
each run once first so every chunk is in the store."""

import argparse
import ctypes
import mmap

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.eval.bench_blend import _blended, musique_setup


def setup(repeats: int):
    """(args, llm, blend manager, BlendConfig(), one-token greedy params, prompts)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    examples, spec, llm = musique_setup(args)
    manager, cfg = llm.blend_manager(), BlendConfig()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = [_blended(ex, spec) for ex in examples]
    for p in prompts:
        llm.generate([p], one, blend=cfg)
    return args, llm, manager, cfg, one, prompts


# Cold pages (cold_load_ab.py, deferred_reads_ab.py): chunk values paged out of LMDB's map.
MADV_PAGEOUT = 21
PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def page_range(tensor):
    start = tensor.data_ptr() // PAGE * PAGE
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE) * PAGE
    return start, end - start


def resident(ranges) -> float:
    """Share of the ranges' pages in memory."""
    total = hit = 0
    for start, length in ranges:
        n = length // PAGE
        vec = (ctypes.c_ubyte * n)()
        assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
        hit += sum(b & 1 for b in vec)
        total += n
    return hit / total


def page_out(store, keys) -> float:
    """Page out the values of ``keys``; the share of their pages still resident after."""
    with store.reader() as reader:
        ranges = [page_range(reader.view(k).kv) for k in keys]
        for start, length in ranges:
            assert libc.madvise(start, length, MADV_PAGEOUT) == 0, ctypes.get_errno()
        return resident(ranges)
