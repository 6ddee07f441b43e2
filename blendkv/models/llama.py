"""Llama / Mistral / SmolLM2 in plain PyTorch, flattened tokens, paged attention behind a backend.

The module tree mirrors transformers' ``LlamaForCausalLM``, so ``named_parameters()`` equal the
checkpoint keys (``model.layers.{i}.self_attn.q_proj.weight``, ...; ``lm_head`` tied to
``embed_tokens`` when ``tie_word_embeddings``) and weights load by name. Residual stream as in
vLLM: layers take and return ``(hidden_states, residual)``, the add inside the next RMSNorm.

``LlamaModel.forward`` holds the only loop over decoder layers; plain steps, blended prefills
and chunk precompute differ only in the row plan and layer hooks (:mod:`blendkv.models.hooks`).

Other families (Mistral, Qwen2, Gemma, ...) are configurations of these classes: a family picks
its decoder-layer class (``LlamaModel.decoder_layer_cls``), the layer picks its attention, norm
and MLP (``attention_cls``, ``norm_cls``, ``make_mlp``) and per-layer attention options
(:meth:`LlamaDecoderLayer.attention_kwargs`: sliding window, soft-cap, scaling); the model picks
each layer's rotary table (:meth:`LlamaModel.layer_rotary`) and scales embeddings
(:meth:`LlamaModel.embed`); the causal LM soft-caps final logits when the config asks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from blendkv.kernels.attention import AttentionBackend, AttentionMetadata, kept_rows
from blendkv.kernels.uploads import upload
from blendkv.layers.attention import Attention
from blendkv.layers.linear import Linear
from blendkv.layers.mlp import GatedMLP
from blendkv.layers.norm import RMSNorm
from blendkv.layers.rotary import RotaryEmbedding
from blendkv.models.hooks import LayerHooks, LayerRows, LayerSeam, RowPlan
from blendkv.models.pieces import EAGER_PIECES, Pieces
from blendkv.models.weights import load_named_weights
from blendkv.models.windows import layer_windows


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer: input norm, attention, post-attention norm (adding the
    residual), MLP. Subclasses swap the classes below or override :meth:`finish`."""

    attention_cls: type[Attention] = Attention
    norm_cls: type[RMSNorm] = RMSNorm
    # The family honours ``config.sliding_window`` (Llama has none; Qwen2's is off by default).
    applies_sliding_window = False

    def __init__(
        self,
        config,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = self.make_norm(config)
        self.self_attn = self.attention_cls(
            config,
            rotary_emb,
            attn_backend,
            qkv_bias,
            o_bias,
            **self.attention_kwargs(config, layer_idx),
        )
        self.post_attention_layernorm = self.make_norm(config)
        self.mlp = self.make_mlp(config)

    def make_norm(self, config, size: int | None = None) -> RMSNorm:
        return self.norm_cls(size or config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config) -> GatedMLP:
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=getattr(config, "mlp_bias", False),
        )

    def attention_kwargs(self, config, layer_idx: int) -> dict:
        """Keyword options for this layer's attention; only those that differ from the plain
        causal softmax are passed (``sliding_window``, ``logits_soft_cap``, ``scaling``)."""
        window = layer_windows(config, self.applies_sliding_window)[layer_idx]
        return {} if window is None else {"sliding_window": window}

    def input_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (normed hidden, residual) entering the attention block."""
        if residual is None:
            return self.input_layernorm(hidden_states), hidden_states
        return self.input_layernorm(hidden_states, residual)

    def finish(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention output -> (hidden, residual) leaving the layer (post-norm + MLP)."""
        hidden_states, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(hidden_states), residual

    def enter(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's dense head: input norm and projections -> pre-RoPE q, k, v and the
        residual."""
        normed, residual = self.input_norm(hidden_states, residual)
        q, k, v = self.self_attn.project(normed)
        return q, k, v, residual

    def leave(
        self, heads: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's dense tail: attention heads [T, H * D] -> ``o_proj``, post-norm, MLP ->
        (hidden, residual) leaving the layer."""
        return self.finish(self.self_attn.o_proj(heads), residual)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        residual: torch.Tensor,
        rows: LayerRows,
        kv_cache: torch.Tensor | None,
        seam: LayerSeam,
        pieces: Pieces = EAGER_PIECES,
    ) -> tuple[torch.Tensor, torch.Tensor, LayerRows] | None:
        """The part of the layer between its dense head and tail (:meth:`enter`,
        :meth:`leave`, which the model's loop runs): the row plan's seams, RoPE, attention
        (writing the rows' K/V into ``kv_cache``) -> (attention heads [rows, H * D], residual,
        rows computed). ``seam`` is this layer's share of the row plan and hooks
        (:class:`~blendkv.models.hooks.LayerSeam`); None when it is ``kv_only``. The heads go
        where ``pieces`` says the next piece reads them (:meth:`Pieces.output`)."""
        attn = self.self_attn
        keep = seam.select_projected(attn, q, k, v, kv_cache, rows.attn_metadata)
        if keep is not None:  # a CPU bool mask over the current rows
            rows = rows.subset(keep)
            kept = kept_rows(keep, q.device)
            residual, q, k, v = (t[kept] for t in (residual, q, k, v))
        md = rows.attn_metadata
        seam.before_attention(attn, q, k, v, kv_cache, md)
        if seam.kv_only:
            seam.save_kv(k, v, kv_cache, md)
            return None
        pruned = seam.output_keep(q.shape[0]) if kv_cache is not None else None
        # RoPE and the rows' K/V into the pool (one launch with the Triton kernels)
        q_rot, k_rot = attn.rotate_and_write(rows.positions, q, k, v, kv_cache, md)
        if pruned is None:
            out = pieces.output("heads", q.shape[0])
            heads = attn.attend_heads(
                q_rot, k_rot, v, kv_cache, md, out=out, kv_written=True, scoring=seam.scoring()
            )
            seam.after_attention(attn, q_rot, kv_cache, md)
            seam.save_kv(k, v, kv_cache, md)
            return heads, residual, rows
        # The rows nobody reads: K/V only.
        seam.save_kv(k, v, kv_cache, md)
        keep, idx = pruned
        rows = rows.subset(keep)
        if len(idx) == 0:
            return q.new_empty(0, attn.num_heads * attn.head_dim), residual[:0], rows
        idx = upload(idx, q.device)
        q, k, v, residual = (t.index_select(0, idx) for t in (q_rot, k_rot, v, residual))
        out = pieces.output("heads", len(idx))
        heads = attn.attend_heads(q, k, v, kv_cache, rows.attn_metadata, out=out, kv_written=True)
        return heads, residual, rows


class LlamaModel(nn.Module):
    """Embeddings, the decoder layers, the final norm. ``rotary_emb`` is the model's (global
    layers') RoPE; :meth:`layer_rotary` gives each layer's."""

    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(
        self, config, attn_backend: AttentionBackend, qkv_bias: bool, o_bias: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = self.make_rotary(config)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(
                config, i, self.layer_rotary(config, i), attn_backend, qkv_bias, o_bias
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = self.decoder_layer_cls.norm_cls(config.hidden_size, eps=config.rms_norm_eps)

    def make_rotary(self, config) -> RotaryEmbedding:
        return RotaryEmbedding(config)

    def layer_rotary(self, config, layer_idx: int) -> RotaryEmbedding:
        """The RoPE of layer ``layer_idx`` (one table for all layers here)."""
        return self.rotary_emb

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> the residual stream entering layer 0 (Gemma scales it)."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        attn_metadata: AttentionMetadata | None,
        row_plan: RowPlan | None = None,
        hooks: LayerHooks | None = None,
        kv_only: bool = False,
        output_rows: torch.Tensor | None = None,
        pieces: Pieces | None = None,
    ) -> torch.Tensor | None:
        """The one layer loop; see :mod:`blendkv.models.hooks` for the seams.

        ``pieces`` runs the dense pieces between attentions (embeddings, each layer's tail and
        the next one's head, the last tail and final norm): eagerly by default, or replayed
        from CUDA graphs (:class:`blendkv.engine.piecewise_graphs.PiecewiseGraphs`). Either
        way the same functions compute them.

        ``kv_only``: the caller wants only the K/V the hooks save (chunk precompute): the last
        layer stops after its projections and None is returned.

        ``output_rows``: ascending CPU indices (into the step's rows) of the rows whose final
        hidden states the caller reads (those it samples from or returns logits of); None = all.
        With a KV pool, the last layer writes every row's K/V but runs attention, ``o_proj``
        and the MLP for those rows only (llama.cpp skips them too): nothing reads the others'
        last-layer outputs. The rows returned are then the output rows among the rows the
        forward computes (``row_plan.rows``, or all), in order.
        """
        _check_kv_caches(kv_caches, attn_metadata, len(self.layers))
        pieces = pieces or EAGER_PIECES
        rows = LayerRows(positions, attn_metadata)
        last = len(self.layers) - 1
        tail = None  # (attention heads, residual) of the layer before: its dense tail is due
        for i, layer in enumerate(self.layers):
            kv_cache = None if kv_caches is None else kv_caches[i]
            seam = LayerSeam(
                i, row_plan, hooks, kv_only and i == last, output_rows if i == last else None
            )
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            # The row-plan seam: rows dropped before this layer are not even projected (nor
            # run through the tail of the layer before: its dense ops are row by row).
            keep = seam.select_unprojected(layer.self_attn, kv_cache, rows.attn_metadata)
            if keep is not None:
                rows, input_ids, tail = _drop_rows(keep, rows, input_ids, tail)
            q, k, v, residual = self._dense_piece(i, pieces, input_ids, tail)
            out = layer(q, k, v, residual, rows, kv_cache, seam, pieces)
            if out is None:  # kv_only: the hooks have the last layer's K/V
                return None
            *tail, rows = out
        if tail[0].shape[0] == 0:  # no output row among the rows computed
            return tail[0].new_empty(0, self.embed_tokens.embedding_dim)
        (hidden_states,) = pieces.run(("last",), self._last, tuple(tail))
        return hidden_states

    def _dense_piece(self, i: int, pieces: Pieces, input_ids: torch.Tensor, tail) -> tuple:
        """One dense piece between attentions: the tail of the layer before (or, with no
        ``tail``, the embeddings), then layer ``i``'s input norm and projections."""
        if tail is None:
            return pieces.run(("first",), self._first, (input_ids,))
        return pieces.run(("link", i), functools.partial(self._link, i), tail)

    def _first(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Piece: embeddings, layer 0's head."""
        return self.layers[0].enter(self.embed(input_ids), None)

    def _link(self, i: int, heads: torch.Tensor, residual: torch.Tensor) -> tuple:
        """Piece: layer ``i - 1``'s tail, layer ``i``'s head."""
        hidden_states, residual = self.layers[i - 1].leave(heads, residual)
        return self.layers[i].enter(hidden_states, residual)

    def _last(self, heads: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor]:
        """Piece: the last layer's tail, the final norm."""
        hidden_states, residual = self.layers[-1].leave(heads, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return (hidden_states,)


def _check_kv_caches(kv_caches, attn_metadata, num_layers: int) -> None:
    """A pool needs metadata, and one cache per layer."""
    if kv_caches is not None and attn_metadata is None:
        raise ValueError("kv_caches need attn_metadata")
    if kv_caches is not None and len(kv_caches) != num_layers:
        raise ValueError(f"expected {num_layers} kv_caches, got {len(kv_caches)}")


def _drop_rows(keep: torch.Tensor, rows: LayerRows, input_ids: torch.Tensor, tail) -> tuple:
    """Only the rows ``keep`` flags, of the row set and of what the next dense piece reads
    (the token ids before layer 0, else the layer before's ``tail``)."""
    rows = rows.subset(keep)
    kept = kept_rows(keep, input_ids.device)
    if tail is None:
        input_ids = input_ids[kept]
    else:
        tail = tuple(t[kept] for t in tail)
    return rows, input_ids, tail


class LlamaForCausalLM(nn.Module):
    """Causal LM over flattened tokens: ``forward`` gives final hidden states, then
    ``compute_logits`` on the rows that need them (vLLM style)."""

    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, config, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        qkv_bias, o_bias = self.attention_bias(config)
        self.model = self.model_cls(config, attn_backend, qkv_bias, o_bias)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @staticmethod
    def attention_bias(config) -> tuple[bool, bool]:
        """(bias of q/k/v_proj, bias of o_proj) for this family."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding Parameter (again, e.g. after ``to_empty``)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None = None,
        attn_metadata: AttentionMetadata | None = None,
        row_plan: RowPlan | None = None,
        hooks: LayerHooks | None = None,
        kv_only: bool = False,
        output_rows: torch.Tensor | None = None,
        pieces: Pieces | None = None,
    ) -> torch.Tensor | None:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden_size].

        ``kv_caches=None`` is a pass without a KV pool: dense causal attention over ONE sequence
        at positions 0..T-1 (``attn_metadata=None``) or over each sequence of a dense metadata
        (:meth:`AttentionBackend.dense_metadata`); otherwise one cache ``[2, num_blocks,
        block_size, kv_heads, head_dim]`` per layer and the step's metadata. With a
        ``row_plan`` the rows returned are ``row_plan.rows``; with ``output_rows`` only those of
        them (:func:`blendkv.models.hooks.output_row_order`).
        """
        return self.model(
            input_ids,
            positions,
            kv_caches,
            attn_metadata,
            row_plan,
            hooks,
            kv_only,
            output_rows,
            pieces,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 logits [N, vocab_size]; with the config's
        ``final_logit_softcapping`` c, ``c * tanh(logits / c)`` in the model dtype first, as
        transformers computes it."""
        logits = self.lm_head(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into parameters by name (cast to each parameter's dtype).

        Raises ModelLoadError naming unexpected, shape-mismatched or missing keys. With tied
        embeddings a stored ``lm_head.weight`` is ignored (it is the embedding matrix). A model
        built on the ``meta`` device gets the checkpoint tensors themselves (no second copy).
        """
        load_named_weights(self, weights)


class MistralDecoderLayer(LlamaDecoderLayer):
    applies_sliding_window = True


class MistralModel(LlamaModel):
    decoder_layer_cls = MistralDecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's module tree and checkpoint keys, with ``sliding_window`` (when set) applied on
    every layer."""

    model_cls = MistralModel
