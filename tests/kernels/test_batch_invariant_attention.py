"""Deterministic attention backends: a sequence's rows come out bit-equal whether the step holds
it alone or with other sequences (fresh prompts, chunks over cached keys, decode rows of other
lengths), and a prompt computed in two chunks equals it computed whole.

Without the mode the chunked prompt differs on the torch and cpu backends (its second chunk
goes through the rows-over-cached-keys kernel, the whole prompt through one causal call); their
default attention is already per sequence, Triton's decode splits follow the step's longest row.
"""

from __future__ import annotations

import pytest
import torch

from blendkv.kernels.backends import get_attention_backend

BACKENDS = ["torch", "cpu", "triton"]
COMPUTED = [0, 6, 20, 3]  # a fresh prompt, a chunk over cached keys, two decode rows
QUERY_LENS = [9, 5, 1, 1]


def backend(name: str, device: str):
    if name == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    if name == "cpu" and device != "cpu":
        pytest.skip("the cpu backend runs on the CPU")
    return get_attention_backend(name, device, deterministic=True)


def attend(be, step, md, q, k, v):
    return be.forward(q, k, v, step.pool.clone(), md, 8**-0.5)


@pytest.mark.parametrize("name", BACKENDS)
def test_rows_equal_alone_and_in_a_batch(name, make_step, device):
    be = backend(name, device)
    step = make_step(COMPUTED, QUERY_LENS, block_size=4, num_kv_heads=2, group=2, seed=3)
    together = attend(be, step, step.md, step.q, step.k, step.v)
    seq_ids = step.md.row_seq_ids()
    for i in range(len(COMPUTED)):
        alone = step.subset(seq_ids == i)
        out = attend(be, alone, alone.md, alone.q, alone.k, alone.v)
        assert torch.equal(out, together[seq_ids == i]), f"sequence {i}"


@pytest.mark.parametrize("name", BACKENDS)
def test_a_prompt_in_chunks_equals_it_whole(name, make_step, device):
    be = backend(name, device)
    step = make_step([0], [9], block_size=4, num_kv_heads=2, group=2, seed=4)
    whole = attend(be, step, step.md, step.q, step.k, step.v)
    table = step.md.block_table[0].tolist()
    pool = step.pool.clone()
    outs = []
    for lo, hi in ((0, 4), (4, 9)):
        md = be.build_metadata([lo], [hi - lo], [table], 4)
        q, k, v = step.q[lo:hi], step.k[lo:hi], step.v[lo:hi]
        outs.append(be.forward(q, k, v, pool, md, 8**-0.5))  # the pool keeps the first chunk
    assert torch.equal(torch.cat(outs), whole)
