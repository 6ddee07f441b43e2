"""The C++ K/V correction (``torch.ops.blendkv_cpu.shift_kept_rows``,
``CpuBlendKernels.shift_kept_rows``) against the torch code of
``correct_kept_rows``, which it replaces."""

from __future__ import annotations

import pytest
import torch
from helpers import needs_cpp_compiler

from blendkv.blend.correction import Rows, correct_kept_rows
from blendkv.kernels.backends import get_blend_kernels
from blendkv.kernels.blend_kernels import BlendKernels
from blendkv.kernels.cpu_attention import CpuAttentionBackend
from blendkv.kernels.torch_attention import TorchAttentionBackend
from blendkv.layers.rotary import RotaryEmbedding

pytestmark = needs_cpp_compiler


def _case(dtype, rope_scaling=None, seed=4):
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        max_position_embeddings=4096,
        rope_scaling=rope_scaling,
    )
    rope = RotaryEmbedding(config)
    g = torch.Generator().manual_seed(seed)
    kv_heads, dim, block_size, num_blocks = 2, rope.head_dim, 4, 40
    pool = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    n = 120
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    positions = torch.arange(n) * 17 + 5
    chunk_of = torch.arange(n) // 30  # 4 chunks of 30 rows
    # Recomputed: a few rows of chunks 0, 2 and 3 (chunk 1 has none: its kept rows stay).
    rec = torch.tensor([1, 4, 5, 9, 62, 63, 70, 91, 95, 118])
    kept = torch.tensor([i for i in range(n) if i not in set(rec.tolist())])
    # The layer's fresh rows: the recomputed ones sit among others, in a fused QKV-like view.
    fused = torch.randn(25, 3 * kv_heads, dim, generator=g).to(dtype)
    k, v = fused[:, :kv_heads], fused[:, kv_heads : 2 * kv_heads]
    rows = torch.tensor([0, 2, 3, 6, 8, 11, 12, 15, 20, 24])
    cpp = get_blend_kernels(CpuAttentionBackend("cpu"))
    return (
        rope,
        pool,
        Rows(positions[rec], slots[rec], chunk_of[rec], rows),
        k,
        v,
        Rows(positions[kept], slots[kept], chunk_of[kept]),
        cpp,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["k", "v", "kv"])
@pytest.mark.parametrize("pooled", [False, True])
def test_cpp_correction_matches_the_torch_code(dtype, which, pooled):
    rope, pool, rec, k, v, kept, cpp = _case(dtype)
    expected, actual = pool.clone(), pool.clone()
    args = (which, 8.0, pooled)
    reference = BlendKernels(TorchAttentionBackend("cpu"))
    correct_kept_rows(reference, rope, expected, *args, rec, k, v, kept, 4)
    assert cpp.fused_chunk_shift
    segments = torch.tensor([0, 4, 4, 7, 10], dtype=torch.int32)  # what the row plan passes
    rec = rec._replace(segments=segments)
    calls = []
    original = cpp.ops

    class Spy:  # the kernel must be the one that ran
        def __getattr__(self, name):
            calls.append(name)
            return getattr(original, name)

    cpp.ops = Spy()
    correct_kept_rows(cpp, rope, actual, *args, rec, k, v, kept, 4)
    assert calls == ["shift_kept_rows"]
    assert not torch.equal(expected, pool)
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)
    else:  # one rounding of the sum apart at most
        torch.testing.assert_close(actual.float(), expected.float(), atol=0, rtol=2**-7)
    chunk1 = kept.chunk_ids == 1
    for half in (0, 1):  # the recomputed rows are untouched, and chunk 1 (no recomputed row)
        flat_a, flat_p = actual[half].flatten(0, 1), pool[half].flatten(0, 1)
        moved = "kv"[half] in which
        # ... unless the prior is the pooled mean
        same = torch.equal(flat_a[kept.slots[chunk1]], flat_p[kept.slots[chunk1]])
        assert same != (pooled and moved)
        assert torch.equal(flat_a[rec.slots], flat_p[rec.slots])


def test_cpp_correction_with_attention_scaling():
    """Scaled RoPE (yarn: cos/sin carry s, read-back K is divided by s^2)."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    rope, pool, rec, k, v, kept, cpp = _case(torch.float32, rope_scaling=scaling, seed=9)
    assert rope.attention_scaling != 1.0
    expected, actual = pool.clone(), pool.clone()
    reference = BlendKernels(TorchAttentionBackend("cpu"))
    correct_kept_rows(reference, rope, expected, "k", 2.0, True, rec, k, v, kept, 4)
    rec = rec._replace(segments=torch.tensor([0, 4, 4, 7, 10], dtype=torch.int32))
    correct_kept_rows(cpp, rope, actual, "k", 2.0, True, rec, k, v, kept, 4)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_cpp_correction_rejects_bad_rows():
    rope, pool, rec, k, v, kept, cpp = _case(torch.float32)
    cos, sin = rope.tables("cpu")
    bad = kept._replace(slots=kept.slots + 10_000)
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        cpp.ops.shift_kept_rows(
            pool,
            1,
            8.0,
            False,
            k,
            v,
            rec.rows,
            rec.slots,
            rec.positions,
            rec.chunk_ids,
            bad.slots,
            bad.positions,
            bad.chunk_ids,
            4,
            cos,
            sin,
            1.0,
        )
    with pytest.raises(RuntimeError, match="chunk index"):
        cpp.ops.shift_kept_rows(
            pool,
            1,
            8.0,
            False,
            k,
            v,
            rec.rows,
            rec.slots,
            rec.positions,
            rec.chunk_ids,
            kept.slots,
            kept.positions,
            kept.chunk_ids,
            2,
            cos,
            sin,
            1.0,
        )
