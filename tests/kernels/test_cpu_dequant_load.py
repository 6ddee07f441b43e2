"""Dequantise at load on the CPU (``torch.ops.blendkv_cpu.dequant_rope_write_kv``): an int8 / int4
chunk decoded, K rotated and written into the pool equals the torch reference (decode with
``store.codecs.decode_reference``, then ``blend_kernels.load_rotated_reference``) bit for bit."""

from __future__ import annotations

import pytest
import torch
from codec_cases import encoded_chunk, rotary_tables
from helpers import needs_cpp_compiler

from blendkv.kernels.kv_dequant import cpu_dequant_rope_write, load_encoded_reference
from blendkv.kernels.torch_attention import TorchAttentionBackend

pytestmark = needs_cpp_compiler


@pytest.fixture(scope="module")
def ops():
    from blendkv.kernels.cpu_extension import load_ops

    return load_ops()


def _load(ops, codec, dtype, outliers, head_dim=8, seed=0):
    chunk = encoded_chunk(codec, dtype, head_dim=head_dim, outliers=outliers, seed=seed)
    # The loader's cut: layers 1.. and tokens 5.. (inside an int4 key group of 32).
    part = chunk[1:, :, 5:]
    num_tokens = part.shape[2]
    gen = torch.Generator().manual_seed(seed)
    pool = [torch.zeros(2, 8, 8, 2, head_dim, dtype=dtype) for _ in range(4)]
    slots = torch.randperm(64, generator=gen)[:num_tokens]
    positions = torch.randint(0, 200, (num_tokens,), generator=gen)
    cos, sin = rotary_tables(256, head_dim)
    expected, actual = [p.clone() for p in pool], [p.clone() for p in pool]
    backend = TorchAttentionBackend("cpu")
    load_encoded_reference(backend, expected, 2, part, positions, slots, cos, sin)
    assert cpu_dequant_rope_write(ops, actual, 2, part, positions, slots, cos, sin)
    return actual, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "codec,outliers", [("int8", False), ("int4", False), ("int4", True)], ids=str
)
def test_decode_rope_write_kv_writes_the_reference_bits(ops, codec, outliers, dtype):
    actual, expected = _load(ops, codec, dtype, outliers)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a.view(torch.int8), e.view(torch.int8))  # bits, NaN-safe
    assert actual[1].abs().sum() == 0 and actual[2].abs().sum() > 0  # layers 2.. only


def test_outlier_keys_override_the_codes(ops):
    """A decoder that ignored the outlier heads would write the codes' keys: not these bits."""
    actual, _ = _load(ops, "int4", torch.float32, True)
    plain, _ = _load(ops, "int4", torch.float32, False)
    assert not torch.equal(actual[3][0], plain[3][0])  # keys of chunk layer 2 (outliers)
    assert torch.equal(actual[2][0], plain[2][0])  # chunk layer 1: no outlier heads
    assert torch.equal(actual[3][1], plain[3][1])  # values: no outliers


def test_decode_rope_write_kv_rejects_a_cut_past_the_chunk(ops):
    chunk = encoded_chunk("int8", torch.float32)
    pool = [torch.zeros(2, 8, 8, 2, 8) for _ in range(3)]
    cos, sin = rotary_tables(64, 8)
    positions = slots = torch.arange(40)  # 40 tokens of a 37-token chunk
    with pytest.raises(RuntimeError, match="tokens out of range"):
        cpu_dequant_rope_write(ops, pool, 0, chunk, positions, slots, cos, sin)
