"""Model building blocks: RoPE, RMSNorm, attention (project/attend split) and the gated MLP."""

from blendkv.layers.attention import Attention
from blendkv.layers.mlp import GatedMLP
from blendkv.layers.norm import RMSNorm
from blendkv.layers.rotary import RotaryEmbedding

__all__ = ["Attention", "GatedMLP", "RMSNorm", "RotaryEmbedding"]
