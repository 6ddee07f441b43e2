"""Switch a loaded model's small element-wise steps to one-launch Triton kernels.

On a GPU a layer's RMSNorms, RoPE and SiLU-and-mul are ~23 eager kernels of little work each;
the host launches them one by one, and a blended prefill (few rows per layer) waits on those
launches rather than on the GPU. :func:`enable_triton_elementwise` points each module at its
kernel in :mod:`blendkv.kernels.triton.elementwise`; the modules keep their torch code as the
reference and for the CPU. The model loader calls it for the Triton attention backend.

Before switching, each kernel runs once on the model's device and dtype against the module's
own torch code (a few rows): a kernel that fails to compile or disagrees is logged and left off,
and the model keeps the torch code for it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def enable_triton_elementwise(model: nn.Module) -> int:
    """Set the kernels on every RMSNorm, RotaryEmbedding and SiLU GatedMLP of ``model`` whose
    kernel passes its check; returns how many modules now use one."""
    from blendkv.kernels.triton import elementwise as ops
    from blendkv.layers.mlp import GatedMLP
    from blendkv.layers.norm import RMSNorm
    from blendkv.layers.rotary import RotaryEmbedding

    kinds = {
        RMSNorm: ("rms_norm", "kernel", ops.rms_norm, _check_norm),
        RotaryEmbedding: ("rotary_qk", "kernel", ops.rotary_qk, _check_rotary),
        GatedMLP: ("silu_and_mul", "act_and_mul", ops.silu_and_mul, _check_act_and_mul),
    }
    like = next(model.parameters())  # the model's device and dtype
    passed: dict[type, bool] = {}
    count = 0
    for module in model.modules():
        kind = kinds.get(type(module))
        if kind is None or (isinstance(module, GatedMLP) and module.hidden_act != "silu"):
            continue
        name, attr, kernel, check = kind
        if type(module) not in passed:
            passed[type(module)] = _passes(name, kernel, check, module, like)
        if passed[type(module)]:
            setattr(module, attr, kernel)
            count += 1
    return count


def _passes(name, kernel, check, module, like: torch.Tensor) -> bool:
    try:
        with torch.no_grad():
            check(kernel, module, like)
    except Exception as e:  # a compile error, a launch failure, a wrong result
        logger.warning(
            "the Triton %s kernel failed its check (%s: %s); that step keeps its torch code",
            name,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return False
    return True


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = 1e-4 if expected.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _random(shape, like: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=like.device, dtype=like.dtype)


def _check_norm(kernel, norm, like) -> None:
    x = _random((3, norm.weight.shape[0]), norm.weight, 0)
    r = _random(x.shape, norm.weight, 1)
    expected, expected_res = norm(x, r)
    out, res = kernel(x.clone(), norm.weight, norm.variance_epsilon, r.clone())
    _close(out, expected)
    _close(res, expected_res)


def _check_rotary(kernel, rope, like) -> None:
    q = _random((3, 2, rope.head_dim), like, 2)
    k = _random((3, 1, rope.head_dim), like, 3)
    positions = torch.tensor([0, 5, min(1000, rope.max_position - 1)], device=like.device)
    expected = rope.apply_rotary(positions, q, k)
    actual = kernel(positions, q, k, *rope.tables(like.device))
    _close(actual[0], expected[0])
    _close(actual[1], expected[1])
    # and with the K/V write into a pool of 2 blocks of 2 (the middle row is padding)
    v = _random(k.shape, like, 4)
    pool = torch.zeros(2, 2, 2, 1, rope.head_dim, dtype=like.dtype, device=like.device)
    slots = torch.tensor([3, -1, 0], device=like.device)
    written = kernel(positions, q, k, *rope.tables(like.device), pool, v, slots)
    _close(written[1], expected[1])
    flat = pool.view(2, 4, 1, rope.head_dim)
    _close(flat[0, [3, 0]], expected[1][[0, 2]])
    _close(flat[1, [3, 0]], v[[0, 2]])
    assert not flat[:, [1, 2]].any()


def _check_act_and_mul(kernel, mlp, like) -> None:
    weight = mlp.down_proj.weight
    gate_up = _random((3, 2 * weight.shape[1]), weight, 4)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(kernel(gate_up), mlp.act_fn(gate) * up)
