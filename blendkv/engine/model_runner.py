"""Turns a :class:`SchedulerOutput` into tensors, runs the model, samples. Makes no decisions.

Owns the paged KV pool: one tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``
(index 0 = K after RoPE, 1 = V); slot ``s`` is block ``s // block_size``, offset
``s % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blendkv.kernels.attention import AttentionMetadata

if TYPE_CHECKING:
    from blendkv.engine.sampler import Sampler
    from blendkv.engine.scheduler import SchedulerOutput
    from blendkv.engine.sequence import Sequence


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_indices: list[int]  # row of the hidden states to sample from, per sampled sequence
    sample_seqs: list[Sequence]
    # Rows whose logits a request asked for (Sequence.logits_from): request_id -> row indices.
    logits_rows: dict[str, list[int]]


@dataclass
class StepResult:
    sampled_seqs: list[Sequence]
    sampled: object  # SamplerOutput, None when no sequence sampled
    logits: dict[str, torch.Tensor]  # request_id -> [rows, vocab] float32 (logits_from)


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
        hf_config,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        sampler: Sampler,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.dtype = dtype
        self.sampler = sampler
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)
        ]
        self.generators: dict[str, torch.Generator] = {}
        self.blend = None  # a BlendExecutor once blending is enabled (blendkv.blend)

    # --------------------------------------------------------------- inputs
    def slot_mapping(self, block_table: list[int], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
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
            pos = torch.arange(start, end, dtype=torch.long)
            positions.append(pos)
            slots.append(self.slot_mapping(seq.block_table, pos))
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_indices.append(query_start_loc[-1] - 1)
                sample_seqs.append(seq)
            if (
                seq.logits_from is not None
                and seq.logits_from < end
                and start < seq.num_prompt_tokens
            ):
                lo = query_start_loc[-2] - start  # row of position 0 of this sequence
                first, last = max(seq.logits_from, start), min(end, seq.num_prompt_tokens)
                logits_rows[seq.request_id] = list(range(lo + first, lo + last))
        max_blocks = max(len(seq.block_table) for seq, _ in out.scheduled)
        block_table = torch.zeros(len(out.scheduled), max_blocks, dtype=torch.int32)
        for i, (seq, _) in enumerate(out.scheduled):
            block_table[i, : len(seq.block_table)] = torch.tensor(seq.block_table)
        md = AttentionMetadata(
            positions=torch.cat(positions).to(self.device),
            slot_mapping=torch.cat(slots).to(self.device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_table=block_table.to(self.device),
            block_size=self.block_size,
            max_query_len=max(n for _, n in out.scheduled),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            is_contiguous_prefill=[True] * len(out.scheduled),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        return ModelInputs(ids, md, sample_indices, sample_seqs, logits_rows)

    # -------------------------------------------------------------- execute
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for kv in self.kv_caches:
            kv[:, dst] = kv[:, src]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step: forward (fused where a blended prefill runs), logits, sampling."""
        self.copy_blocks(out.blocks_to_copy)
        inputs = self.prepare_inputs(out)
        blending = self.blend.blending(out.scheduled) if self.blend is not None else []
        if blending:
            hidden, rows = self.blend.forward(
                self.model, inputs, out.scheduled, self.kv_caches, blending
            )
            where = {r: i for i, r in enumerate(rows.tolist())}
            remap = lambda idx: [where[i] for i in idx]  # noqa: E731
        else:
            md = inputs.attn_metadata
            hidden = self.model(inputs.input_ids, md.positions, self.kv_caches, md)
            remap = lambda idx: idx  # noqa: E731
        logits = {
            rid: self.model.compute_logits(hidden[remap(idx)])
            for rid, idx in inputs.logits_rows.items()
        }
        if not inputs.sample_seqs:
            return StepResult([], None, logits)
        sample_logits = self.model.compute_logits(hidden[remap(inputs.sample_indices)])
        sampled = self.sample(sample_logits, inputs.sample_seqs)
        return StepResult(inputs.sample_seqs, sampled, logits)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        params = [seq.sampling_params for seq in seqs]
        generators = [self._generator(seq) for seq in seqs]
        num_output_tokens = [seq.num_output_tokens for seq in seqs]
        return self.sampler.sample(logits, params, generators, num_output_tokens)

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
