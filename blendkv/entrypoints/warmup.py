"""Warm-up at load: one short request through the engine, so that the first user request's TTFT
is what every later one sees.

The first forward of a process pays one-time costs that are not its request's: the GEMM
library's and the C++ kernels' first calls (thread pool, packed weights, per-shape set-up),
torch's first dispatch of each op, and on CUDA the Triton compiles and the decode CUDA-graph
capture. One greedy request of a short plain prompt (a prefill step, then a decode step) runs
the same layers and attention kernels as a blended one, and writes nothing to a chunk store;
the blend connector's store is still opened on first use. The runner also probes whether
chunk precompute may pack chunks (:mod:`blendkv.engine.chunk_packing`), which a live step
would otherwise pay for. Afterwards the block pool is
replaced by a fresh one, so the warm-up leaves no cached prefix and no trace in block order.

``LLM(warmup=False)`` (``--no-warmup``) skips it (the test suite does: it builds many engines
and times none of their first requests). The Triton interpreter (``attention_backend="triton"``
on the CPU, a test mode) compiles nothing, so there is nothing to warm and the warm-up is
skipped there.
"""

from __future__ import annotations

import time

from blendkv.engine.block_manager import BlockManager
from blendkv.sampling_params import SamplingParams

WARMUP_REQUEST_ID = "blendkv-warmup"
# Prompt rows of the warm-up's prefill; long enough for the kernels' blocked paths.
WARMUP_PROMPT_TOKENS = 64
_TEXT = "Warm-up: the engine runs this prompt once at load and discards the answer. "


def needs_warmup(engine) -> bool:
    """False where the first call costs nothing extra (the Triton interpreter on the CPU)."""
    return not (engine.attn_backend.name == "triton" and engine.device == "cpu")


def warm_up(engine, num_prompt_tokens: int = WARMUP_PROMPT_TOKENS) -> float:
    """Run one greedy request (``num_prompt_tokens`` prompt tokens, two output tokens) on an
    idle ``engine`` and reset its block pool; returns the seconds it took (0 when skipped)."""
    assert not engine.has_unfinished_requests(), "warm up an idle engine"
    if not needs_warmup(engine):
        return 0.0
    start = time.perf_counter()
    num_tokens = min(num_prompt_tokens, engine.info.max_model_len - 2)
    if num_tokens < 1:
        return 0.0
    text_ids = engine.tokenize(_TEXT)
    prompt = (text_ids * (num_tokens // len(text_ids) + 1))[:num_tokens]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params, request_id=WARMUP_REQUEST_ID)
    while engine.has_unfinished_requests():
        engine.step()
    engine.runner.probe_chunk_packing()  # not in a live step's time
    _fresh_block_pool(engine)
    return time.perf_counter() - start


def _fresh_block_pool(engine) -> None:
    """Give engine and scheduler a new, empty block manager of the same shape."""
    old = engine.block_manager
    assert old.num_free_blocks == old.num_blocks, "the warm-up request left blocks allocated"
    fresh = BlockManager(
        old.num_blocks,
        old.block_size,
        old.enable_prefix_caching,
        place_in_runs=old.place_in_runs,
    )
    engine.block_manager = engine.scheduler.block_manager = fresh
    engine._last_step_num_scheduled = 0
