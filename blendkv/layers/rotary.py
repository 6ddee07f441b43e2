"""Rotary position embedding (RoPE), gathered at arbitrary absolute positions.

Inverse frequencies come from transformers' ``ROPE_INIT_FUNCTIONS`` (``llama3``,
``linear``, ``yarn``, ``longrope``, ... and their ``attention_scaling``). cos/sin are precomputed
in float32 and *gathered* at ``positions``, so query rows may be scattered (CacheBlend) and stored
keys re-rotated at load (:meth:`RotaryEmbedding.rotate_k`). HF's ``rotate_half`` convention, not
GPT-J's interleaving.

A position's rotation must not depend on the sequence length (stored and cached K keep it), so
``longrope`` uses its short factors below ``original_max_position_embeddings`` and its long ones
from there on (vLLM's choice; transformers switches the whole sequence to the long factors once
it is longer). ``dynamic`` keeps its original-context frequencies at every length.

Partial rotary (``partial_rotary_factor`` < 1, Phi-4-mini) keeps the tables ``head_dim`` wide, so
every kernel that takes them is unchanged: the model permutes each head's q/k dims at load
(:meth:`RotaryEmbedding.head_layout`) so that rotary pairs sit ``head_dim // 2`` apart, and the
pass-through dims get cos = ``attention_scaling``, sin = 0 (their weights divided by it).
"""

from __future__ import annotations

import torch
from torch import nn

from blendkv.errors import ModelLoadError

_MEMO_SIZE = 4  # cos/sin gathers remembered (positions tensors, by identity)


def rope_parameters(config) -> dict:
    """``config.rope_parameters`` (transformers 5), or the same dict built from the v4 fields."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    scaling["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return scaling


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim_of(config) -> int:
    """The rotated dims of a head: ``head_dim * partial_rotary_factor`` (as transformers)."""
    factor = rope_parameters(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", 1.0)
    return int(head_dim_of(config) * factor)


# Rope types whose frequencies are fixed per position (``dynamic``: see the module doc).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def compute_inv_freq(config, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention_scaling) exactly as transformers computes;
    ``long``: ``longrope``'s long-context factors. Unknown rope types raise ModelLoadError."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        # Transformers keeps "default" in each model file (LlamaRotaryEmbedding); same formula.
        dim = rotary_dim_of(config)
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    if rope_type not in SUPPORTED_ROPE_TYPES or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(
            f"rope_type {rope_type!r} is not supported "
            f"(blendkv supports: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    kwargs = {}
    if long:
        kwargs["seq_len"] = params["original_max_position_embeddings"] + 1
    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention_scaling = init(config, torch.device("cpu"), **kwargs)
    return inv_freq.float().cpu(), float(attention_scaling)


def _longrope_switch(config) -> int | None:
    """The first position of ``longrope``'s long factors; None for other rope types."""
    params = rope_parameters(config)
    if params.get("rope_type") != "longrope" or params.get("long_factor") is None:
        return None
    return int(params["original_max_position_embeddings"])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` of the two halves of the last dim, written into one new tensor."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.neg(x[..., half:], out=out[..., :half])
    out[..., half:].copy_(x[..., :half])
    return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with the same roundings, in two new tensors instead
    of five (faster on the CPU: docs/benchmarks.md)."""
    return torch.mul(x, cos).add_(rotate_half(x).mul_(sin))


class RotaryEmbedding(nn.Module):
    """RoPE for one model; shared by all its attention layers.

    The cos/sin table is deliberately a plain attribute, not a buffer: the loader builds the model
    on the ``meta`` device and ``Module.to(dtype)`` would cast a buffer to bf16, but the table
    must stay real float32. It follows the inputs' device lazily.
    """

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.max_position = max_position or config.max_position_embeddings
        # Real CPU tensors even when the model is built under `with torch.device("meta")`.
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = compute_inv_freq(config)
            switch = _longrope_switch(config)
            long_inv_freq = compute_inv_freq(config, long=True)[0] if switch else inv_freq
        self.rotary_dim = 2 * inv_freq.numel()
        if self.rotary_dim > self.head_dim or (self.head_dim - self.rotary_dim) % 2:
            raise ModelLoadError(
                f"rotary_dim {self.rotary_dim} does not fit head_dim {self.head_dim} "
                "(partial rotary needs an even number of pass-through dims)"
            )
        # Same float32 product as transformers (position * inv_freq), so cos/sin match bit for bit.
        with torch.device("cpu"):
            positions = torch.arange(self.max_position, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim // 2]
            if switch is not None and switch < self.max_position:
                freqs[switch:] = positions[switch:, None] * long_inv_freq[None, :]
            cos = freqs.cos() * self.attention_scaling
            sin = freqs.sin() * self.attention_scaling
            # Pass-through dims (partial rotary): x * scaling + 0 (weights divided at load).
            num_pass = (self.head_dim - self.rotary_dim) // 2
            cos = torch.cat(
                (cos, cos.new_full((self.max_position, num_pass), self.attention_scaling)), -1
            )
            sin = torch.cat((sin, sin.new_zeros(self.max_position, num_pass)), -1)
            # Both halves stored, so a lookup is one gather (no per-layer concatenation).
            self._cos = torch.cat((cos, cos), dim=-1)
            self._sin = torch.cat((sin, sin), dim=-1)
        # Every layer of one forward passes the same positions tensor: gather once per forward.
        # A few entries, matched by identity: a blended forward also rotates its kept rows'
        # K corrections at their own (per-step fixed) positions every layer.
        self._memo: list[tuple] = []
        # One-launch RoPE of q and k (blendkv.layers.fused_kernels, GPUs); None = torch ops.
        self.kernel = None

    @property
    def is_partial(self) -> bool:
        return self.rotary_dim < self.head_dim

    def head_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(perm [head_dim] int64, scale [head_dim] float32) for partial rotary: row ``j`` of a
        head's q/k projection here is checkpoint row ``perm[j]`` times ``scale[j]``.

        transformers rotates dims ``[0, r)`` as pairs ``(i, i + r/2)`` and passes ``[r, D)``
        through; here pairs are ``(j, j + D/2)`` (``rotate_half`` over the whole head)::

            here:        [ rot 0..r/2 | pass 1st half | rot r/2..r | pass 2nd half ]
            checkpoint:  [ rot 0..r   | pass r..D ]

        Pass-through rows are divided by ``attention_scaling``, which their table entries
        multiply back. q.k sums over all dims, so scores are unchanged; identity for full
        rotary.
        """
        d, r = self.head_dim, self.rotary_dim
        h, p = d // 2, (d - r) // 2
        rot = torch.arange(r // 2)
        pas = torch.arange(p)
        perm = torch.cat((rot, r + pas, r // 2 + rot, r + p + pas))
        scale = torch.ones(d)
        scale[r // 2 : h] = scale[h + r // 2 :] = 1.0 / self.attention_scaling
        return perm, scale

    def to_head_layout(self, weight: torch.Tensor, num_heads: int) -> torch.Tensor:
        """A q or k projection's checkpoint rows [num_heads * head_dim, ...] (weight or bias)
        in :meth:`head_layout`; unchanged without partial rotary."""
        if not self.is_partial:
            return weight
        perm, scale = self.head_layout()
        shaped = weight.reshape(num_heads, self.head_dim, *weight.shape[1:])
        scale = scale.to(weight.dtype).reshape(-1, *([1] * (weight.dim() - 1)))
        return (shaped[:, perm] * scale).reshape(weight.shape)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin gathered at ``positions``: [T, 1, head_dim] each, cast to ``dtype``."""
        for seen, seen_dtype, cos, sin in self._memo:
            if seen is positions and seen_dtype == dtype:
                return cos, sin
        if self._cos.device != positions.device:
            self._cos = self._cos.to(positions.device)
            self._sin = self._sin.to(positions.device)
        cos = self._cos.index_select(0, positions)[:, None, :].to(dtype)
        sin = self._sin.index_select(0, positions)[:, None, :].to(dtype)
        self._memo = [*self._memo[-(_MEMO_SIZE - 1) :], (positions, dtype, cos, sin)]
        return cos, sin

    def clear_memo(self) -> None:
        """Forget the gathered cos/sin (a CUDA-graph capture must record the gather)."""
        self._memo = []

    def tables(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole float32 cos/sin tables, [max_position, head_dim] each, on ``device``."""
        if self._cos.device != torch.device(device):
            self._cos = self._cos.to(device)
            self._sin = self._sin.to(device)
        return self._cos, self._sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, head_dim] whose row ``i`` sits at absolute ``positions[i]``."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return _rope(x, cos, sin)

    def apply_rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k [T, kv_heads, head_dim] -> both rotated (new tensors)."""
        if self.kernel is not None and k.dtype == q.dtype:
            cos, sin = self.tables(q.device)
            return self.kernel(positions, q, k, cos, sin)
        cos, sin = self.cos_sin(positions, q.dtype)
        return _rope(q, cos, sin), _rope(k, cos.to(k.dtype), sin.to(k.dtype))

    def rotate_and_write(self, positions, q, k, v, kv_cache, slot_mapping, write_kv):
        """:meth:`apply_rotary`, and the rotated K with V written into ``kv_cache`` at
        ``slot_mapping``: in the kernel's one launch when it has one, else by ``write_kv(kv_cache,
        k, v, slot_mapping)`` (the attention backend's)."""
        if self.kernel is not None and k.dtype == q.dtype:
            cos, sin = self.tables(q.device)
            return self.kernel(positions, q, k, cos, sin, kv_cache, v, slot_mapping)
        q, k = self.apply_rotary(positions, q, k)
        write_kv(kv_cache, k, v, slot_mapping)
        return q, k

    def rotate_k(self, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """RoPE on pre-RoPE keys alone (the chunk store re-rotates stored K to new positions)."""
        return self.rotate(positions, k)

    def unrotate_k(self, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`rotate_k` (keys read back from the pool, pre-RoPE again).

        cos/sin carry ``attention_scaling`` s, so rotating scales by s: undo it too."""
        cos, sin = self.cos_sin(positions, k.dtype)
        out = torch.mul(k, cos).sub_(rotate_half(k).mul_(sin))
        return out.div_(self.attention_scaling**2)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply_rotary(positions, q, k)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}"
        )
