"""Batch-invariant mode (``deterministic=True``): greedy answers of requests sent together equal
their answers sent one at a time, in bfloat16.

The default mode is run on the same setup and should differ somewhere, so the equality in
deterministic mode proves something: the requests sent one at a time come after the batch,
their prompts' blocks then hit the prefix cache and go through other attention kernels (rows
over cached keys instead of one causal call), whose rounding flips near-tied tokens. Where a
CPU's kernels round alike on both paths, the default-mode case is skipped and says so.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import QuietLLM, make_tiny_model_dir

from blendkv import LLM, SamplingParams
from blendkv.layers.linear import row_tiled_linear

WORDS = "the a river city capital France Paris over dog fox quick lazy museum park Berlin".split()
MAX_TOKENS = 24


def prompts(n: int = 10) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # wider than the shared tiny model: more rounding to flip near-ties in the default mode
    path = tmp_path_factory.mktemp("det") / "m"
    return make_tiny_model_dir(path, hidden_size=256, intermediate_size=512)


def batch_and_sequential(llm: LLM, texts: list[str]) -> tuple[list, list]:
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    batch = [list(o.outputs[0].token_ids) for o in llm.generate(texts, sp)]
    alone = [list(llm.generate([t], sp)[0].outputs[0].token_ids) for t in texts]
    return batch, alone


@pytest.mark.parametrize("deterministic", [False, True])
def test_batch_equals_sequential_only_when_deterministic(model_dir, deterministic):
    llm = QuietLLM(str(model_dir), dtype="bfloat16", deterministic=deterministic)
    batch, alone = batch_and_sequential(llm, prompts())
    differ = [i for i, (a, b) in enumerate(zip(batch, alone, strict=True)) if a != b]
    if deterministic:
        assert differ == []
    elif not differ:  # the setup should show the variance the mode removes
        # Some CPUs' bf16 kernels round a row alike at every batch size and over cached keys
        # (seen on an AMD EPYC with AVX-512 BF16): the default mode is then invariant here too.
        pytest.skip("the default mode gives the same answers on this CPU: no variance to remove")


def test_row_tiled_linear_is_batch_invariant_in_float32():
    """float32's one-row GEMM is a matrix-vector product that rounds otherwise than the
    blocked kernel; row tiles give each row the same result at every batch size."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen)
    x = torch.randn(37, 80, generator=gen)
    alone = torch.cat([row_tiled_linear(x[i : i + 1], w, b, 16) for i in range(37)])
    assert torch.equal(row_tiled_linear(x, w, b, 16), alone)
    assert torch.equal(row_tiled_linear(x[5:29], w, b, 16), alone[5:29])
    torch.testing.assert_close(alone, torch.nn.functional.linear(x, w, b))
