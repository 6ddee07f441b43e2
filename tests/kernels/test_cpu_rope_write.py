"""The C++ K/V load (``torch.ops.blendkv_cpu.rope_write_kv``: a stored chunk's K rotated to its
positions in the prompt and written into the pool with its V) against its reference,
``blend_kernels.load_rotated_reference`` (torch RoPE, then ``write_kv``): the same bits."""

from __future__ import annotations

import pytest
import torch
from helpers import needs_cpp_compiler

from blendkv.kernels.blend_kernels import BlendKernels, load_rotated_reference
from blendkv.kernels.cpu_blend import rope_write_applies
from blendkv.kernels.torch_attention import TorchAttentionBackend

pytestmark = needs_cpp_compiler


def _tables(positions: int, head_dim: int):
    inv = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float().contiguous(), angles.sin().float().contiguous()


def _case(dtype, heads=3, head_dim=64, layers=4, tokens=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = [torch.zeros(2, 8, 16, heads, head_dim, dtype=dtype) for _ in range(layers)]
    # Scattered slots: runs across blocks, out of order, a lone slot.
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    positions = torch.randint(0, 2000, (tokens,), generator=gen)
    kv = (torch.randn(layers - 1, 2, tokens, heads, head_dim, generator=gen) * 4).to(dtype)
    return pool, kv, positions, slots, _tables(2048, head_dim)


@pytest.fixture(scope="module")
def ops():
    from blendkv.kernels.cpu_extension import load_ops

    return load_ops()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (2, 128), (1, 6)])
def test_rope_write_kv_writes_the_reference_bits(ops, dtype, heads, head_dim):
    pool, kv, positions, slots, (cos, sin) = _case(dtype, heads, head_dim)
    assert rope_write_applies(kv, pool, 1, positions, slots, cos, sin)
    backend = TorchAttentionBackend("cpu")
    expected, actual = [p.clone() for p in pool], [p.clone() for p in pool]
    load_rotated_reference(backend, expected, 1, kv, positions, slots, cos, sin)
    ops.rope_write_kv(kv, actual, 1, positions, slots, cos, sin)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a.view(torch.int8), e.view(torch.int8))  # bits, NaN-safe
    assert actual[0].abs().sum() == 0 and actual[1].abs().sum() > 0  # layers 1.. only


def test_the_cpu_backend_loads_through_the_kernel(ops, monkeypatch):
    """The cpu backend's blend kernels' ``load_rotated_kv`` takes the kernel (and writes the same
    bits as the torch reference); arguments the kernel does not take (a float16 pool) still
    load."""
    import blendkv.kernels.cpu_blend as cpu_blend
    from blendkv.kernels.backends import get_blend_kernels
    from blendkv.kernels.cpu_attention import CpuAttentionBackend

    pool, kv, positions, slots, (cos, sin) = _case(torch.float32, seed=3)
    backend = BlendKernels(TorchAttentionBackend("cpu"))
    reference = [p.clone() for p in pool]
    backend.load_rotated_kv(reference, 1, kv, positions, slots, cos, sin)
    backend = get_blend_kernels(CpuAttentionBackend("cpu"))
    calls = []
    monkeypatch.setattr(
        cpu_blend, "rope_write_applies", lambda *a: calls.append(a) or rope_write_applies(*a)
    )
    actual = [p.clone() for p in pool]
    backend.load_rotated_kv(actual, 1, kv, positions, slots, cos, sin)
    assert len(calls) == 1
    assert all(torch.equal(a, r) for a, r in zip(actual, reference, strict=True))
    half = [p.half() for p in pool]
    assert not rope_write_applies(kv.half(), half, 1, positions, slots, cos, sin)
    backend.load_rotated_kv(half, 1, kv.half(), positions, slots, cos, sin)
    assert half[1].abs().sum() > 0


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(slots=a["slots"] + 1000), "slot out of the pool"),
        (lambda a: a.update(positions=a["positions"] + 5000), "position out of the table"),
        (lambda a: a.update(first_layer=2), "layers out of range"),
        (lambda a: a.update(slots=a["slots"].int()), "int64"),
        (lambda a: a.update(kv=a["kv"].half()), "float32 or bfloat16"),
        (lambda a: a.update(pools=[p.double() for p in a["pools"]]), "dtype"),
        (lambda a: a.update(cos=a["cos"][:, :32]), "cos and sin"),
    ],
)
def test_rope_write_kv_rejects_bad_arguments(ops, change, message):
    pool, kv, positions, slots, (cos, sin) = _case(torch.float32)
    args = dict(pools=pool, first_layer=1, positions=positions, slots=slots, cos=cos, sin=sin)
    args["kv"] = kv
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.rope_write_kv(
            args["kv"],
            args["pools"],
            args["first_layer"],
            args["positions"],
            args["slots"],
            args["cos"],
            args["sin"],
        )
