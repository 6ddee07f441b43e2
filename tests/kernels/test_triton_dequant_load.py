"""Dequantise at load in Triton (``dequant_rope_load``, under ``TRITON_INTERPRET=1`` without CUDA):
an int8 / int4 chunk decoded, K rotated and written equals the torch reference
(``decode_reference`` then ``rope_load_reference``) bit for bit, on one pool and on separate
layer caches, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from codec_cases import encoded_chunk, rotary_tables

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from blendkv.kernels.triton.rope_load import (  # noqa: E402
    dequant_rope_load,
    dequant_rope_load_reference,
)


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "codec,outliers,layout",
    [
        ("int8", False, "one_pool"),
        ("int4", False, "separate"),
        ("int4", True, "one_pool"),
        ("int4", True, "separate"),
    ],
    ids=str,
)
def test_decode_rope_load_writes_the_reference_bits(device, codec, outliers, layout, dtype):
    chunk = encoded_chunk(codec, dtype, tokens=13, outliers=outliers, seed=2)
    chunk = chunk[1:, :, 4:].to(device)  # the loader's cut: layers 1.., tokens 4..
    num_tokens = chunk.shape[2]
    gen = torch.Generator().manual_seed(3)
    shape = (2, 4, 4, 2, 8)  # 4 blocks of 4
    if layout == "one_pool":
        caches = list(torch.randn(4, *shape, generator=gen).to(dtype=dtype, device=device))
    else:
        caches = [torch.randn(shape, generator=gen).to(dtype=dtype, device=device) for _ in "abcd"]
    slots = torch.randperm(16, generator=gen)[:num_tokens]
    slots[3] = -1  # skipped
    positions = torch.randint(0, 60, (num_tokens,), generator=gen)
    cos, sin = (t.to(device) for t in rotary_tables(64, 8))
    slots, positions = slots.to(device), positions.to(device)
    expected, actual = [c.clone() for c in caches], [c.clone() for c in caches]
    dequant_rope_load_reference(expected, 2, chunk, positions, slots, cos, sin)
    dequant_rope_load(actual, 2, chunk, positions, slots, cos, sin)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a.view(torch.int8), e.view(torch.int8))  # bits
    assert torch.equal(actual[1], caches[1]) and not torch.equal(actual[2], caches[2])
