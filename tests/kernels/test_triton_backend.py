"""The Triton backend against the torch backend on whole steps (CPU: Triton's interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton backend cannot run")

from blendkv.kernels.blend_kernels import BlendKernels  # noqa: E402
from blendkv.kernels.torch_attention import TorchAttentionBackend  # noqa: E402
from blendkv.kernels.triton.rope_load import rope_load_reference  # noqa: E402
from blendkv.kernels.triton_attention import TritonAttentionBackend  # noqa: E402
from blendkv.kernels.triton_blend import TritonBlendKernels  # noqa: E402

SCALE = 0.35


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:  # bf16: kernels accumulate in float32, the reference in bf16 steps
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=1.6e-2)


def mixed_step(make_step, dtype, group):
    """fresh prefill | chunked prefill from 6 (ends mid-block) | decode | prefix hit with
    scattered rows (positions 4..12, every other row kept, plus the last)."""
    step = make_step(
        [0, 6, 13, 4],
        [7, 5, 1, 9],
        block_size=4,
        num_kv_heads=2,
        group=group,
        dtype=dtype,
    )
    keep = torch.ones(step.md.num_tokens, dtype=torch.bool)
    scattered = torch.arange(14, 22)  # rows of the last sequence but its first
    keep[scattered[::2]] = False
    return step.subset(keep.to(step.q.device))


@pytest.mark.parametrize(
    ("dtype", "group"), [(torch.float32, 3), (torch.bfloat16, 1)], ids=["gqa3-fp32", "gqa1-bf16"]
)
def test_forward_matches_torch_backend_on_a_mixed_step(make_step, device, dtype, group):
    step = mixed_step(make_step, dtype, group)
    md = step.md
    assert md.is_contiguous_prefill == [True, True, True, False]
    pools = step.pool.clone(), step.pool.clone()
    expected = TorchAttentionBackend(device).forward(step.q, step.k, step.v, pools[0], md, SCALE)
    backend = TritonAttentionBackend(device)
    actual = backend.forward(step.q, step.k, step.v, pools[1], md, SCALE)
    assert_close(actual, expected)
    assert torch.equal(pools[1], pools[0])  # the same K/V written to the same slots

    # The dispatch layout is built once per metadata object: a second layer reuses it.
    layout = backend._layout(md, group, False, 2)
    again = backend.forward(step.q, step.k, step.v, pools[1], md, SCALE)
    assert backend._layout(md, group, False, 2) is layout
    assert torch.equal(again, actual)
    assert layout.fresh_ranges == [(0, 7)]
    assert layout.decode_seq_ids.tolist() == [2]
    assert sorted(set(layout.tile_seq_ids.tolist())) == [1, 3]
    assert layout.prefill_splits == 1  # short keys: nothing to split


def test_few_rows_over_long_keys_split_the_keys(make_step, device):
    """A reuse's query rows after 600 stored keys: too few tiles to fill a GPU, so each tile's
    keys are cut in parts (prefill_num_splits) and combined; the same output as torch's."""
    step = make_step([600, 700], [3, 2], block_size=16, num_kv_heads=2, group=2)
    md = step.md
    pools = step.pool.clone(), step.pool.clone()
    expected = TorchAttentionBackend(device).forward(step.q, step.k, step.v, pools[0], md, SCALE)
    backend = TritonAttentionBackend(device)
    actual = backend.forward(step.q, step.k, step.v, pools[1], md, SCALE)
    assert backend._layout(md, 2, False, 2).prefill_splits == 2  # >= 256 keys a part
    assert_close(actual, expected)


def test_forward_without_a_pool_matches_torch_backend(device):
    gen = torch.Generator().manual_seed(3)
    ref = TorchAttentionBackend(device)
    md = ref.dense_metadata([5, 1, 3])
    q = torch.randn(9, 4, 8, generator=gen).to(device)
    k, v = (torch.randn(9, 2, 8, generator=gen).to(device) for _ in range(2))
    expected = ref.forward(q, k, v, None, md, SCALE)
    backend = TritonAttentionBackend(device)
    assert_close(backend.forward(q, k, v, None, md, SCALE), expected)
    assert_close(backend.forward(q[:5], k[:5], v[:5], None, None, SCALE), expected[:5])


def test_load_rotated_kv_writes_every_layer(device):
    gen = torch.Generator().manual_seed(4)
    pool = torch.zeros(3, 2, 3, 4, 2, 8, device=device)  # [layers, 2, blocks, block_size, H, D]
    caches, expected = list(pool), [c.clone() for c in pool]
    kv = torch.randn(3, 2, 5, 2, 8, generator=gen).to(device)
    positions = torch.arange(10, 15, device=device)
    slots = torch.tensor([2, 3, 4, 5, 6], device=device)
    angles = torch.arange(32.0)[:, None] * torch.linspace(1.0, 0.01, 4)[None, :]
    cos, sin = (f(torch.cat((angles, angles), dim=-1)).to(device) for f in (torch.cos, torch.sin))
    rope_load_reference(expected, 0, kv, positions, slots, cos, sin)
    # The base class's load_rotated_kv is the engine's reference: same result as ours.
    by_base = [c.clone() for c in pool]
    torch_kernels = BlendKernels(TorchAttentionBackend(device))
    torch_kernels.load_rotated_kv(by_base, 0, kv, positions, slots, cos, sin)
    triton_kernels = TritonBlendKernels(TritonAttentionBackend(device))
    triton_kernels.load_rotated_kv(caches, 0, kv, positions, slots, cos, sin)
    for actual, ref, base in zip(caches, expected, by_base, strict=True):
        assert torch.equal(base, ref)
        assert_close(actual, ref)


def test_backend_module_imports_no_kernels():
    # (torch._dynamo may import triton itself; what must not happen is our kernels compiling.)
    code = (
        "import sys, blendkv.kernels.triton_attention\n"
        "assert 'blendkv.kernels.triton' not in sys.modules, 'kernels imported at module import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
