"""Attention with a per-head norm on q and k before RoPE (Qwen3, Gemma 3, OLMo-2-style heads).

``q_norm`` / ``k_norm`` normalise each head's ``head_dim`` vector (one weight of ``head_dim``
shared by all heads). The norm sits inside :meth:`QKNormAttention.project`, so the pre-RoPE K the
chunk store keeps, re-rotates and blends is the normed K, exactly what transformers rotates.
The norm class is a parameter: Qwen3 uses :class:`~blendkv.layers.norm.RMSNorm` (``w * x``),
Gemma 3 its ``(1 + w) * x`` variant.
"""

from __future__ import annotations

import torch
from torch import nn

from blendkv.kernels.attention import AttentionBackend
from blendkv.layers.attention import Attention
from blendkv.layers.norm import RMSNorm
from blendkv.layers.rotary import RotaryEmbedding


class QKNormAttention(Attention):
    """:class:`~blendkv.layers.attention.Attention` plus ``q_norm`` and ``k_norm`` (checkpoint
    keys ``self_attn.q_norm.weight``, ``self_attn.k_norm.weight``) over ``head_dim``.

    ``qk_norm_cls(head_dim, eps=...)`` builds both norms (default ``RMSNorm``); ``eps`` is
    ``config.rms_norm_eps``. Other keywords go to :class:`Attention` (window, soft-cap, scale).
    """

    def __init__(
        self,
        config,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
        qkv_bias: bool = False,
        o_bias: bool = False,
        *,
        qk_norm_cls: type[nn.Module] = RMSNorm,
        **kwargs,
    ) -> None:
        super().__init__(config, rotary_emb, attn_backend, qkv_bias, o_bias, **kwargs)
        self.q_norm = qk_norm_cls(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = qk_norm_cls(self.head_dim, eps=config.rms_norm_eps)

    def project(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden_size] -> normed pre-RoPE q [T, H, D], normed k [T, Hkv, D], v."""
        q, k, v = super().project(hidden_states)
        # 3-D inputs: the norms' 2-D one-launch kernels (GPUs) stay out of the way.
        return self.q_norm(q), self.k_norm(k), v
