"""Switch a loaded model's small element-wise steps to one-launch Triton kernels.

On a GPU a layer's RMSNorms, RoPE and SiLU-and-mul are ~23 eager kernels of little work each;
the host launches them one by one, and a blended prefill (few rows per layer) waits on those
launches rather than on the GPU. :func:`enable_triton_elementwise` points each module at its
kernel in :mod:`blendkv.kernels.triton.elementwise`; the modules keep their torch code as the
reference and for the CPU. The model loader calls it for the Triton attention backend.
"""

from __future__ import annotations

from torch import nn


def enable_triton_elementwise(model: nn.Module) -> int:
    """Set the kernels on every RMSNorm, RotaryEmbedding and SiLU GatedMLP of ``model``;
    returns how many modules now use one."""
    from blendkv.kernels.triton import elementwise as ops
    from blendkv.layers.mlp import GatedMLP
    from blendkv.layers.norm import RMSNorm
    from blendkv.layers.rotary import RotaryEmbedding

    count = 0
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = ops.rms_norm
        elif isinstance(module, RotaryEmbedding):
            module.kernel = ops.rotary_qk
        elif isinstance(module, GatedMLP) and module.hidden_act == "silu":
            module.act_and_mul = ops.silu_and_mul
        else:
            continue
        count += 1
    return count
