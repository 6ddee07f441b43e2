"""Turns a :class:`SchedulerOutput` into tensors, runs the model, samples. Makes no decisions.

The runner runs every forward pass of the engine, each through the model's one layer loop:

- the step's batch (prefills, decodes, fused prefills), then sampling;
- chunk precompute: a document chunk prefilled alone behind its context, its K/V handed to the
  KV connector to store (``SchedulerOutput.precompute``, and ingest);
- a query pass before a fused prefill (``SchedulerOutput.query_passes``), with the row plan the
  connector gives it, eagerly or replayed from a captured graph;
- an audit's full prefill (``SchedulerOutput.audits``): the logits of its last rows.

The paged KV pool (one tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``)
is allocated, written and read by the attention backend; a KV connector, if any, loads external
K/V into it before the forward and gives the forward its row plan and layer hooks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blendkv.engine.chunk_packing import PACK_ROWS, PROBED_PACK_ROWS, pack, packing_is_exact
from blendkv.engine.kv_connector import ForwardInputs
from blendkv.engine.penalties import TokenCounts
from blendkv.errors import PromptTooLongError
from blendkv.kernels.attention import AttentionBackend, AttentionMetadata, KVCacheSpec
from blendkv.kernels.uploads import upload_list
from blendkv.models.hooks import LayerHooks, QueryPass, output_row_order

if TYPE_CHECKING:
    from blendkv.engine.kv_connector import KVConnectorBase
    from blendkv.engine.sampler import Sampler
    from blendkv.engine.scheduler_output import AuditWork, PrecomputeWork, SchedulerOutput
    from blendkv.engine.sequence import Sequence


logger = logging.getLogger(__name__)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_indices: list[int]  # row of the hidden states to sample from, per sampled sequence
    sample_seqs: list[Sequence]
    # Rows whose logits a request asked for (Sequence.logits_from): request_id -> row indices.
    logits_rows: dict[str, list[int]]

    def output_rows(self) -> torch.Tensor | None:
        """Ascending CPU indices of the rows whose final hidden states the step reads (sampled
        or returned as logits); None when that is every row (decode-only steps)."""
        rows = set(self.sample_indices)
        for idx in self.logits_rows.values():
            rows.update(idx)
        if len(rows) == len(self.input_ids):
            return None
        return torch.tensor(sorted(rows), dtype=torch.long)


@dataclass
class StepResult:
    sampled_seqs: list[Sequence]
    sampled: object  # SamplerOutput, None when no sequence sampled
    logits: dict[str, torch.Tensor]  # request_id -> [rows, vocab] float32 (logits_from)
    # The rows each sampled sequence's token was drawn from, before any sampling parameter:
    # [len(sampled_seqs), vocab] float32 on the device (the blend audit keeps some).
    sample_logits: torch.Tensor | None = None


def kv_block_bytes(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    per_layer = 2 * block_size * hf_config.num_key_value_heads * head_dim
    element = torch.empty((), dtype=dtype).element_size()
    return per_layer * hf_config.num_hidden_layers * element


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        kv_cache_spec: KVCacheSpec,
        sampler: Sampler,
        connector: KVConnectorBase,
        prune_last_layer: bool = True,
        row_tiled: bool = False,
    ) -> None:
        """``prune_last_layer``: the last layer attends and runs its MLP only for the rows the
        step reads (``EngineConfig.prune_last_layer``). ``row_tiled``: the model's GEMMs are
        row-tiled (``EngineConfig.deterministic``), so chunk precompute packs up to
        ``PACK_ROWS`` rows of chunks per forward; otherwise a probe decides
        (:mod:`blendkv.engine.chunk_packing`)."""
        self.model = model
        self.prune_last_layer = prune_last_layer
        # rows per packed chunk forward; None: not probed yet (the warm-up or the first
        # precompute of several chunks probes)
        self.pack_rows: int | None = PACK_ROWS if row_tiled else None
        self.attn_backend = attn_backend
        self.spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.device = attn_backend.device
        self.sampler = sampler
        self.connector = connector
        self.kv_caches = attn_backend.allocate_kv_cache(kv_cache_spec)
        self.generators: dict[str, torch.Generator] = {}
        # Output-token counts of the requests with a penalty; made at the first such request
        # (its vocabulary size is the logits').
        self.token_counts: TokenCounts | None = None
        # Captured decode steps (blendkv.engine.cuda_graphs), and the dense pieces of other
        # steps (blendkv.engine.piecewise_graphs): set up by the engine on CUDA.
        self.decode_graphs = None
        self.piece_graphs = None
        self.query_graphs = None  # query passes replayed whole (engine.query_pass_graphs)
        # Grammar matchers for structured outputs (StructuredOutputs), set up by the engine.
        self.structured_outputs = None

    # --------------------------------------------------------------- inputs
    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        input_ids: list[int] = []
        row = 0
        sample_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        logits_rows: dict[str, list[int]] = {}
        for seq, num_new in out.scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            if num_new == 1 and start == seq.num_tokens - 1:
                input_ids.append(seq.token_id_at(start))  # decode: avoid copying all ids
            else:
                input_ids.extend(seq.all_token_ids[start:end])
            row += num_new
            if end == seq.num_tokens:
                for sampled in (seq, *out.forked.get(seq.request_id, ())):
                    sample_indices.append(row - 1)  # forked samples share the parent's row
                    sample_seqs.append(sampled)
            if (
                seq.logits_from is not None
                and seq.logits_from < end
                and start < seq.num_prompt_tokens
            ):
                lo = row - num_new - start  # row of position 0 of this sequence
                first, last = max(seq.logits_from, start), min(end, seq.num_prompt_tokens)
                logits_rows[seq.request_id] = list(range(lo + first, lo + last))
        md = self.attn_backend.build_metadata(
            [seq.num_computed_tokens for seq, _ in out.scheduled],
            [n for _, n in out.scheduled],
            [seq.block_table for seq, _ in out.scheduled],
            self.block_size,
        )
        ids = upload_list(input_ids, torch.long, self.device)
        return ModelInputs(ids, md, sample_indices, sample_seqs, logits_rows)

    # ------------------------------------------------------------ precompute
    @torch.inference_mode()
    def run_precompute(
        self, out: SchedulerOutput, skip: Container[str] = ()
    ) -> list[tuple[PrecomputeWork, float]]:
        """The step's chunk precompute, before the batch: each chunk's K/V to the connector.
        Returns each item run with the seconds its forward took (a packed forward's time
        shared by the items' tokens). ``skip``: request ids whose items are dropped, read
        before each forward (an abort announced while the step runs)."""
        done = []
        works = [w for w in out.precompute if w.request_id not in skip]
        sizes = [len(w.context_ids) + len(w.chunk_ids) for w in works]
        for group in ([works[i] for i in g] for g in pack(sizes, self._pack_rows(len(works)))):
            group = [w for w in group if w.request_id not in skip]
            if not group:
                continue
            t0 = time.perf_counter()
            contexts = [list(w.context_ids) for w in group]
            kvs = self.compute_chunk_kv(contexts, [list(w.chunk_ids) for w in group])
            seconds = time.perf_counter() - t0
            rows = sum(len(w.context_ids) + len(w.chunk_ids) for w in group)
            for work, kv in zip(group, kvs, strict=True):
                share = seconds * (len(work.context_ids) + len(work.chunk_ids)) / rows
                self.connector.save_chunk_kv(work, kv, share)
                done.append((work, share))
        return done

    @torch.inference_mode()
    def compute_chunk_kv(
        self, contexts: list[list[int]], chunks: list[list[int]]
    ) -> list[torch.Tensor]:
        """K (before RoPE) and V of each chunk prefilled alone at the positions after its
        context (``contexts[i]``: the anchor's ids, or the anchor and the previous chunk's last
        ids): ``[num_layers, 2, len(chunk), kv_heads, head_dim]`` each, on the model's device.

        Stored K/V is addressed by content, so its bits must not depend on which chunks were
        computed beside it: several chunks share a forward (each its own sequence) only where
        that gives each the bits it gets alone (:mod:`blendkv.engine.chunk_packing`). No KV
        pool (dense metadata); the last layer stops after its projections (``kv_only``): its
        attention and MLP are never used.
        """
        limit = self.model.model.rotary_emb.max_position
        for context, chunk in zip(contexts, chunks, strict=True):
            assert chunk, "empty chunks are rejected before precompute"
            if len(context) + len(chunk) > limit:
                raise PromptTooLongError(
                    f"a chunk of {len(chunk)} tokens behind the {len(context)}-token anchor "
                    f"exceeds the model's {limit} positions; split it into smaller chunks"
                )
        pairs = list(zip(contexts, chunks, strict=True))
        groups = pack([len(c) + len(k) for c, k in pairs], self._pack_rows(len(pairs)))
        return [kv for g in groups for kv in self._chunk_forward([pairs[i] for i in g])]

    def _pack_rows(self, num_chunks: int) -> int:
        """Rows per packed chunk forward (0: one chunk per forward); probed once, when several
        chunks first come to be computed (or at the warm-up)."""
        if num_chunks > 1:
            self.probe_chunk_packing()
        return self.pack_rows or 0

    @torch.inference_mode()
    def probe_chunk_packing(self) -> None:
        """Decide :attr:`pack_rows` once, from a probe of this model's forward
        (:func:`~blendkv.engine.chunk_packing.packing_is_exact`): a few forwards of up to 512
        rows."""
        if self.pack_rows is None:
            model = self.model.model
            longest = min(256, model.rotary_emb.max_position)
            exact = packing_is_exact(
                self._chunk_forward, model.embed_tokens.num_embeddings, longest=longest
            )
            self.pack_rows = PROBED_PACK_ROWS if exact else 0
            logger.info("chunk precompute packing: %s", "exact, on" if exact else "off")

    def _chunk_forward(self, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """One forward of ``(context, chunk)`` sequences; each chunk's K/V."""
        spec, device = self.spec, self.device
        outs, spans, ids, row = [], [], [], 0
        for context, chunk in pairs:
            outs.append(
                torch.empty(
                    (spec.num_layers, 2, len(chunk), spec.num_kv_heads, spec.head_dim),
                    dtype=spec.dtype,
                    device=device,
                )
            )
            spans.append((row + len(context), row + len(context) + len(chunk)))
            ids.extend(context)
            ids.extend(chunk)
            row += len(context) + len(chunk)
        md = self.attn_backend.dense_metadata([len(c) + len(k) for c, k in pairs])
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        saver = _ChunkKVSaver(outs, spans)
        self.model(input_ids, md.positions, None, md, hooks=saver, kv_only=True)
        return outs

    # ----------------------------------------------------------------- audit
    @torch.inference_mode()
    def full_prefill_logits(self, work: AuditWork) -> torch.Tensor:
        """Logits ``[num_rows, vocab]`` (float32, CPU) of an audit's last ``work.num_rows``
        rows under plain full prefill: one forward without the KV pool (dense metadata), as
        chunk precompute runs."""
        token_ids, k = list(work.token_ids), work.num_rows
        assert 1 <= k <= len(token_ids)
        md = self.attn_backend.dense_metadata([len(token_ids)])
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        rows = torch.arange(len(token_ids) - k, len(token_ids), dtype=torch.long)
        hidden = self.model(ids, md.positions, None, md, output_rows=rows)
        return self.model.compute_logits(hidden[-k:]).float().cpu()

    # -------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step: external K/V in, a query pass if asked, forward (one layer loop),
        logits, sampling."""
        self.attn_backend.copy_blocks(self.kv_caches, out.blocks_to_copy)
        inputs = self.prepare_inputs(out)
        md = inputs.attn_metadata
        conn = self.connector
        conn.bind_connector_metadata(out.kv_connector_metadata)
        try:
            fwd = ForwardInputs(
                inputs.input_ids, md, self.kv_caches, self.compute_chunk_kv, self._graph_captures
            )
            conn.start_load_kv(fwd)
            if out.query_passes:
                query_pass = conn.query_pass(fwd)
                if query_pass is not None:
                    self._run_query_pass(query_pass)
            plan = conn.row_plan(fwd)
            outputs = inputs.output_rows() if self.prune_last_layer else None
            if plan is None and self._use_graphs(md):
                hidden = self.decode_graphs.run(inputs.input_ids, md)
                outputs = None
            else:
                hidden = self.model(
                    inputs.input_ids,
                    md.positions,
                    self.kv_caches,
                    md,
                    row_plan=plan,
                    hooks=conn,
                    output_rows=outputs,
                    pieces=self.piece_graphs,
                )
            conn.wait_for_save()
        finally:
            conn.clear_connector_metadata()
        remap = _identity
        if plan is not None or outputs is not None:
            rows = output_row_order(plan, outputs, len(inputs.input_ids))
            where = {r: i for i, r in enumerate(rows.tolist())}
            remap = lambda idx: [where[i] for i in idx]  # noqa: E731
        # Prompt logits are user-facing output: handed back on the CPU.
        logits = {
            rid: self.model.compute_logits(hidden[remap(idx)]).cpu()
            for rid, idx in inputs.logits_rows.items()
        }
        if not inputs.sample_seqs:
            return StepResult([], None, logits)
        sample_logits = self.model.compute_logits(hidden[remap(inputs.sample_indices)])
        sampled = self.sample(sample_logits, inputs.sample_seqs)
        return StepResult(inputs.sample_seqs, sampled, logits, sample_logits)

    def _run_query_pass(self, query_pass: QueryPass) -> None:
        """A query pass over the loaded K/V: replayed from a captured graph where it can (each
        segment after its layers' loads), else through the layer loop, each layer after its
        loaded K/V (the connector's hooks)."""
        graphs, replay, plan = self.query_graphs, query_pass.replay, query_pass.row_plan
        if graphs is not None and replay is not None:
            if graphs.can_run(len(replay.input_ids), replay.seq_len):
                scores = graphs.run(
                    replay.input_ids,
                    replay.positions,
                    replay.slot_mapping,
                    replay.first_query_row,
                    replay.seq_lens,
                    replay.block_table,
                    self.connector.wait_for_layer_load,
                )
                if scores is not None:  # None: the capture failed, eager from now on
                    plan.take_replayed(scores[: replay.seq_len])
                    return
        md = query_pass.attn_metadata
        plan.begin()
        self.model(
            query_pass.input_ids,
            md.positions,
            self.kv_caches,
            md,
            row_plan=plan,
            hooks=self.connector,
            kv_only=query_pass.kv_only,
            pieces=self.piece_graphs,
        )
        plan.finish()

    def make_query_graphs(self, max_model_len: int, max_rows: int):
        """Query passes replayed whole (:class:`QueryPassGraphs`, each padded size captured at
        its first use), on a backend whose attention leaves the log-sum-exp the scores read;
        None elsewhere."""
        from blendkv.engine.query_pass_graphs import QueryPassGraphs

        if self.attn_backend.query_scoring != "from_lse" or max_rows < 1:
            return None
        return QueryPassGraphs(
            self.model,
            self.attn_backend,
            self.kv_caches,
            self.block_size,
            max_model_len,
            min(256, max_rows),
        )

    def _graph_captures(self) -> int:
        """CUDA graphs captured so far by this runner's dense pieces."""
        return getattr(self.piece_graphs, "captures", 0)

    def _use_graphs(self, md: AttentionMetadata) -> bool:
        # Graph replay runs no Python, so no per-layer connector hooks either.
        graphs = self.decode_graphs
        return graphs is not None and not self.connector.needs_layer_hooks() and graphs.can_run(md)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        params = [seq.sampling_params for seq in seqs]
        generators = [self._generator(seq) for seq in seqs]
        num_output_tokens = [seq.num_output_tokens for seq in seqs]
        penalties = None
        if any(p.has_penalties for p in params):
            if self.token_counts is None:
                self.token_counts = TokenCounts(logits.shape[-1], logits.device)
            penalties = self.token_counts.inputs(seqs)
        so = self.structured_outputs
        bitmask = so.bitmask(seqs, logits.shape[-1], logits.device) if so is not None else None
        out = self.sampler.sample(
            logits, params, generators, num_output_tokens, penalties, token_bitmask=bitmask
        )
        if bitmask is not None:
            so.accept(seqs, out.token_ids)
        return out

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[seq.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        if self.structured_outputs is not None:
            self.structured_outputs.release(request_id)
        if self.token_counts is not None:
            self.token_counts.release(request_id)


def _identity(idx: list[int]) -> list[int]:
    return idx


class _ChunkKVSaver(LayerHooks):
    """Copies each chunk's rows of fresh K (before RoPE) and V of every layer into its
    tensor (``spans``: each chunk's rows in the forward)."""

    def __init__(self, outs: list[torch.Tensor], spans: list[tuple[int, int]]) -> None:
        self.outs = outs
        self.spans = spans

    def save_kv_layer(self, layer_idx, k, v, kv_cache, attn_metadata) -> None:
        for out, (lo, hi) in zip(self.outs, self.spans, strict=True):
            out[layer_idx, 0] = k[lo:hi]
            out[layer_idx, 1] = v[lo:hi]
