"""Self-attention split into the steps the blending code calls one at a time.

``project`` gives pre-RoPE q/k/v (the chunk store keeps K before RoPE); ``attend`` rotates,
hands q/k/v to the attention backend (which writes K/V into the paged cache and attends) and
applies ``o_proj``; ``forward`` composes the two. The model's layer loop calls the backend part
alone (``attend_heads``): ``project`` and ``o_proj`` belong to the dense pieces around it,
which a step may replay from CUDA graphs (:mod:`blendkv.engine.piecewise_graphs`). Shapes
are flattened over tokens (no batch):

    hidden [T, hidden_size] --project--> q [T, num_heads, head_dim]
                                         k, v [T, num_kv_heads, head_dim]
    --attend(positions, ...)--> [T, hidden_size]
"""

from __future__ import annotations

import torch
from torch import nn

from blendkv.kernels.attention import AttentionBackend, AttentionMetadata, QueryScoring
from blendkv.layers.fused import FusedLinear
from blendkv.layers.linear import Linear
from blendkv.layers.rotary import RotaryEmbedding, head_dim_of


class Attention(nn.Module):
    """Parameter names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) equal HF checkpoint keys.

    Per-layer attention constants, handed to every backend call that attends or scores:
    ``sliding_window`` (a query at ``p`` sees keys ``p - w < j <= p``, transformers' rule;
    None: all keys ``<= p``), ``logits_soft_cap`` (scores ``cap * tanh(s / cap)`` before the
    softmax, Gemma 2), ``scaling`` (the softmax scale; None: ``head_dim ** -0.5``)."""

    def __init__(
        self,
        config,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
        qkv_bias: bool = False,
        o_bias: bool = False,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        scaling: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        self.scaling = self.head_dim**-0.5 if scaling is None else float(scaling)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        # Shared objects, not owned submodules' parameters: the table has no checkpoint key and
        # the backend is not an nn.Module.
        self.rotary_emb = rotary_emb
        self.attn_backend = attn_backend
        self.fused_qkv = None  # set by fuse() once weights are loaded

    def project(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden_size] -> pre-RoPE q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]."""
        t = hidden_states.shape[0]
        if self.fused_qkv is not None:
            q, k, v = self.fused_qkv(hidden_states)
        else:
            q, k, v = (p(hidden_states) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def fuse(self) -> None:
        """One GEMM for q/k/v from now on (parameters become views; names unchanged)."""
        self.fused_qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])

    def attend(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """RoPE at ``positions`` [T], backend attention (writes K/V to the cache), ``o_proj``."""
        q, k = self.rotary_emb.apply_rotary(positions, q, k)
        return self.o_proj(self.attend_heads(q, k, v, kv_cache, attn_metadata))

    def attend_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
        out: torch.Tensor | None = None,
        kv_written: bool = False,
        scoring: QueryScoring | None = None,
    ) -> torch.Tensor:
        """The backend's attention on rotated q/k (writing K/V to the cache unless
        ``kv_written``: :meth:`rotate_and_write` did), heads flattened: [T, num_heads *
        head_dim], before ``o_proj`` (which the decoder layer's dense tail applies:
        :meth:`LlamaDecoderLayer.leave`); ``out`` [T, num_heads * head_dim]: where to write
        them (then returned); ``scoring``: a query pass's (the backend's ``forward``)."""
        kwargs = self.attention_kwargs()
        if out is not None:
            kwargs["out"] = out.view(q.shape)
        if kv_written:
            kwargs["kv_written"] = True
        if scoring is not None:
            kwargs["scoring"] = scoring
        heads = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scaling, **kwargs)
        return heads.reshape(heads.shape[0], self.num_heads * self.head_dim)

    def attention_kwargs(self) -> dict:
        """``window``/``soft_cap`` for the backend when this layer has either, else ``{}`` (the
        plain path, and backends' older signatures, untouched)."""
        if self.sliding_window is None and self.logits_soft_cap is None:
            return {}
        return {"window": self.sliding_window, "soft_cap": self.logits_soft_cap}

    def mass_kwargs(self) -> dict:
        """:meth:`attention_kwargs` plus ``scale`` when it is not ``head_dim ** -0.5``: the
        keywords of ``AttentionBackend.add_query_mass`` for this layer."""
        kwargs = self.attention_kwargs()
        if self.scaling != self.head_dim**-0.5:
            kwargs["scale"] = self.scaling
        return kwargs

    def rotate_and_write(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q/k and every row's K/V written into the cache (one launch with the Triton
        RoPE kernel), without attending; -> rotated q, k, for :meth:`attend_heads` with
        ``kv_written``. Without a cache: RoPE only."""
        if kv_cache is None:
            return self.rotary_emb.apply_rotary(positions, q, k)
        return self.rotary_emb.rotate_and_write(
            positions, q, k, v, kv_cache, attn_metadata.slot_mapping, self.attn_backend.write_kv
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        q, k, v = self.project(hidden_states)
        return self.attend(positions, q, k, v, kv_cache, attn_metadata)
