"""The engine loop: requests in, one scheduled step at a time, outputs out.

``LLMEngine`` wires model loading, the KV pool size, the attention backend, the KV connector
(``EngineConfig.kv_connector``; blending is one), the scheduler, the model runner and the output
processing (detokenisation, stop checks). ``blendkv.LLM`` is the friendly front end.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from blendkv.config import (
    EngineConfig,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from blendkv.engine.block_manager import BlockManager
from blendkv.engine.cuda_graphs import DecodeGraphs
from blendkv.engine.input_processor import InputProcessor, PreparedRequest
from blendkv.engine.kv_connector import KVConnectorContext, create_kv_connector
from blendkv.engine.model_runner import ModelRunner
from blendkv.engine.parallel_sampling import (
    ParentRequest,
    child_request_id,
    child_sampling_params,
)
from blendkv.engine.piecewise_graphs import PiecewiseGraphs
from blendkv.engine.request_state import RequestState
from blendkv.engine.runtime_info import runtime_info
from blendkv.engine.sampler import Sampler
from blendkv.engine.scheduler import Scheduler
from blendkv.engine.sequence import Sequence, SequenceStatus
from blendkv.engine.step_cost import StepCostModel, chunk_forward_work
from blendkv.engine.structured_output import StructuredOutputs
from blendkv.errors import ConfigError, InvalidRequestError
from blendkv.guards.audit import Auditor
from blendkv.guards.fidelity_controller import FidelityController
from blendkv.kernels.attention import KVCacheSpec
from blendkv.kernels.backends import get_attention_backend, get_blend_kernels
from blendkv.layers.batch_invariant import enable_batch_invariance
from blendkv.layers.cpu_platform import apply_cpu_tuning, decide_cpu_tuning
from blendkv.models.model_files import load_model, load_tokenizer, resolve_model
from blendkv.outputs import RequestOutput
from blendkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """Counts of the engine's state now (pure ints; read them from the engine's thread)."""

    num_running: int
    num_waiting: int  # precomputing ones included
    num_kv_blocks_used: int
    num_kv_blocks: int
    last_step_num_scheduled: int  # requests (decodes and prefill pieces) in the last step
    num_generated_tokens: int  # output tokens sampled since the engine started (all samples)
    num_precomputing: int = 0  # waiting for their documents' K/V (hold no blocks)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self._load_model()
        self.hf_config = self.model.config
        self.info = runtime_info(
            config, self.model, self.tokenizer, self.resolved.name, self.device, self.dtype
        )
        # Holds fidelity targets on live traffic: their ratios move by the audits' divergence
        # (blendkv.guards.fidelity_controller); the connector resolves targets through it.
        self.fidelity = FidelityController()
        self.kv_connector = create_kv_connector(
            config.kv_connector,
            KVConnectorContext(
                config,
                self.model,
                self.tokenizer,
                self.attn_backend,
                self.blend_kernels,
                self.info,
                self.resolved,
                fidelity=self.fidelity,
            ),
        )
        self.scheduler = self._make_scheduler()
        self.runner = self._make_runner()
        self.requests: dict[str, RequestState] = {}  # by sequence (sample) id
        self.parents: dict[str, ParentRequest] = {}  # n > 1 requests, by request id
        # Requests an abort is on its way for (request_abort, from any thread): the running
        # step computes no more of their precompute.
        self._aborting: set[str] = set()
        self._ids = itertools.count()
        self.processor = InputProcessor(
            self.tokenizer,
            self.info,
            config.scheduler.max_num_seqs,
            self.kv_connector,
            self._id_in_use,
        )
        self._last_step_num_scheduled = 0
        self._num_generated_tokens = 0

    def _make_scheduler(self) -> Scheduler:
        """The block manager, the auditor, the step cost model and the scheduler over them."""
        config = self.config
        self.block_manager = BlockManager(
            self.info.num_kv_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            place_in_runs=self.attn_backend.prefers_block_runs,
        )
        # Full prefill of a sampled share of blended requests, when idle (blendkv.guards.audit).
        self.auditor = Auditor(config.guards.blend_audit_rate, config.seed)
        # What steps cost here, learned from the steps run (blendkv.engine.step_cost).
        self.step_costs = StepCostModel()
        sched = config.scheduler
        return Scheduler(
            self.block_manager,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            connector=self.kv_connector,
            auditor=self.auditor,
            max_step_latency=sched.max_step_latency,
            step_costs=self.step_costs,
        )

    def _load_model(self) -> None:
        """The model, its tokenizer, the attention backend and the blend's kernels on its pool,
        on the configured device."""
        config = self.config
        self.resolved = resolve_model(config.model, cache_dir=config.cache_dir)
        self.tokenizer = load_tokenizer(self.resolved)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.torch_dtype = getattr(torch, self.dtype)
        backend = resolve_attention_backend(config.attention_backend, self.device)
        try:
            self.attn_backend = get_attention_backend(
                backend, self.device, config.deterministic, config.kernels
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.blend_kernels = get_blend_kernels(self.attn_backend)
        self.model = load_model(self.resolved, self.torch_dtype, self.attn_backend, self.device)
        # GEMM library, packed rows, MLP slices: platform decisions, made once here.
        self.cpu_tuning = decide_cpu_tuning(
            self.model, self.torch_dtype, self.device, gemm=config.cpu_gemm
        )
        apply_cpu_tuning(self.model, self.cpu_tuning)
        if config.deterministic:  # after the tuning: row tiles replace its packed GEMMs
            enable_batch_invariance(self.model)

    def _make_runner(self) -> ModelRunner:
        """The model runner over a new KV pool, with its CUDA graphs where they apply."""
        config, info = self.config, self.info
        spec = KVCacheSpec(
            num_layers=info.num_layers,
            num_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            dtype=self.torch_dtype,
        )
        runner = ModelRunner(
            self.model,
            self.attn_backend,
            spec,
            Sampler(info.eos_token_ids),
            connector=self.kv_connector,
            prune_last_layer=config.prune_last_layer,
            row_tiled=config.deterministic,
        )
        runner.structured_outputs = StructuredOutputs(self.tokenizer)
        graphs = self.device.startswith("cuda") and not config.enforce_eager
        if graphs and self.attn_backend.supports_cuda_graphs:
            runner.decode_graphs = DecodeGraphs(
                self.model,
                self.attn_backend,
                runner.kv_caches,
                info.block_size,
                config.scheduler.max_num_seqs,
                info.max_model_len,
            )  # captured on the first decode step
        if graphs and config.max_graph_rows:  # (no attention inside: any backend)
            # each piece is captured at its first use of a size
            runner.piece_graphs = PiecewiseGraphs(self.device, config.max_graph_rows)
            if self.kv_connector.runs_query_passes:  # (ProphetKV's first stage)
                runner.query_graphs = runner.make_query_graphs(
                    info.max_model_len, config.max_graph_rows
                )
        return runner

    def close(self) -> None:
        """Flush and release the KV connector (a blend store's pending writes land first)."""
        self.kv_connector.close()

    # ------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.processor.tokenize(prompt)

    def validate(self, prompt_token_ids: list[int], params: object) -> SamplingParams:
        """Raise a typed error for a request that cannot be served; the engine is untouched."""
        return self.processor.validate(prompt_token_ids, params)

    def prepare_request(
        self,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        blend: object = None,
        logits_from: int | None = None,
        token_map: bool = False,
    ) -> PreparedRequest:
        """Tokenise and validate one request without queueing it (raises typed errors).

        A dict prompt is a blended prompt (see :mod:`blendkv.blend`), ``blend`` its
        :class:`~blendkv.blend.BlendConfig`. ``logits_from`` asks for the logits of every prompt
        position from that one on (``RequestOutput.extra["prompt_logits"]``). ``token_map``
        (blended prompts) asks how each prompt token was computed: its outputs'
        ``blend_stats.token_map`` (:mod:`blendkv.blend.token_map`); without it nothing is
        recorded. Touches no engine state: it may run on another thread than the engine's
        (:mod:`.input_processor`).
        """
        return self.processor.prepare_request(
            prompt,
            sampling_params,
            request_id,
            blend=blend,
            logits_from=logits_from,
            token_map=token_map,
        )

    def add_prepared(self, req: PreparedRequest) -> str:
        """Queue a request made by :meth:`prepare_request`; returns its id.

        With ``n > 1`` the request is n sequences (:mod:`blendkv.engine.parallel_sampling`);
        only the first is queued, the others are forked from it once its prompt is computed.
        """
        if req.request_id is not None and self._id_in_use(req.request_id):
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        request_id = req.request_id if req.request_id is not None else str(next(self._ids))
        while req.request_id is None and self._id_in_use(request_id):
            request_id = str(next(self._ids))
        params = req.sampling_params
        ids = [child_request_id(request_id, i) for i in range(params.n)]
        taken = [i for i in ids[1:] if self._id_in_use(i)]
        if taken:
            raise InvalidRequestError(
                f"request id {taken[0]!r} (a sample of {request_id!r}) is already in use"
            )
        sample_params = [params]
        if params.n > 1:
            sample_params = [child_sampling_params(params, i) for i in range(params.n)]
        room = self.info.max_model_len - len(req.prompt_token_ids)
        max_tokens = params.max_tokens
        max_out = min(max_tokens, room) if max_tokens is not None else room
        states = []
        for sample_id, p in zip(ids, sample_params, strict=True):
            seq = Sequence(sample_id, req.prompt_token_ids, p, max_out)
            seq.cache_salt = req.cache_salt
            states.append(RequestState(seq, req.prompt, self.tokenizer))
        first = states[0].seq
        first.logits_from = req.logits_from
        self.kv_connector.add_request(request_id, req.kv_transfer_params)
        if req.approximate and params.n == 1:  # n > 1 is never audited
            # a target's request: its audit (target, ratio run) feeds the fidelity controller
            target = getattr(req.stats, "fidelity_target", None)
            ratio = req.stats.chosen_recompute_ratio if target is not None else None
            self.auditor.choose(request_id, req.prompt_token_ids, req.stats, target, ratio)
        first.pending_children = [state.seq for state in states[1:]]
        if params.n > 1:
            self.parents[request_id] = ParentRequest(request_id, states)
        for state in states:
            self.requests[state.seq.request_id] = state
        self.scheduler.add(first)
        return request_id

    def _id_in_use(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.parents

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs,
    ) -> str:
        """Validate and queue one request; returns its id. Nothing is queued on error.

        Keyword arguments are those of :meth:`prepare_request` (``blend``, ``logits_from``,
        ``token_map``).
        """
        return self.add_prepared(
            self.prepare_request(prompt, sampling_params, request_id, **kwargs)
        )

    def request_abort(self, request_id: str) -> None:
        """Announce an abort from another thread while a step may be running: that step
        computes no more of the request's chunk precompute (chunks already computed stay
        stored). The caller then calls :meth:`abort_request` on the engine's thread."""
        self._aborting.add(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its samples); False if it is unknown or already finished."""
        self._aborting.discard(request_id)
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            return self._abort_samples(parent)
        seq = self.scheduler.abort(request_id)
        state = self.requests.pop(request_id, None)
        self.runner.release(request_id)
        self.kv_connector.request_finished(request_id)
        self.auditor.request_finished(request_id)
        if state is not None and seq is not None:
            state.finish_reason = "abort"
        return seq is not None

    def _abort_samples(self, parent: ParentRequest) -> bool:
        running = [state for state in parent.states if not state.finished]
        for state in running:
            seq = state.seq
            if self.scheduler.abort(seq.request_id) is None:
                seq.status = SequenceStatus.FINISHED_ABORTED  # not forked yet: holds no blocks
            self.requests.pop(seq.request_id, None)
            self.runner.release(seq.request_id)
            state.finish_reason = "abort"
        self.kv_connector.request_finished(parent.request_id)
        self.auditor.request_finished(parent.request_id)
        return bool(running)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; return outputs of requests that produced a token."""
        out = self.scheduler.schedule()
        self._last_step_num_scheduled = len(out.scheduled)
        for work, seconds in self.runner.run_precompute(out, skip=self._aborting):
            self.step_costs.record(chunk_forward_work(work.num_tokens), seconds)
        for audit in out.audits:
            record = self.auditor.record(audit.request_id, self.runner.full_prefill_logits(audit))
            if record.fidelity_target is not None:
                self.fidelity.observe(record)
        if not out.scheduled:
            self.scheduler.update_from_output(out)
            return []
        t0 = time.perf_counter()
        result = self.runner.execute(out)
        self.step_costs.record(out.work, time.perf_counter() - t0)
        sampled_seqs, sampled = result.sampled_seqs, result.sampled
        for request_id, logits in result.logits.items():
            self.requests[request_id].add_prompt_logits(logits)
        self.scheduler.update_from_output(out)
        now = time.perf_counter()
        outputs = []
        parents: dict[str, ParentRequest] = {}  # n > 1 requests with a new token, in order
        for i, seq in enumerate(sampled_seqs):
            if seq.is_finished:
                continue
            state = self.requests[seq.request_id]
            self._num_generated_tokens += 1
            if self.auditor.is_audited(seq.request_id):  # (blendkv.guards.audit)
                self.auditor.take_sample(
                    seq.request_id, result.sample_logits[i], sampled.token_ids[i]
                )
            status = state.append(
                sampled.token_ids[i],
                sampled.logprobs[i],
                sampled.top_logprobs[i],
                now,
                self.info.eos_token_ids,
            )
            if status is not None:
                self.scheduler.finish(seq, status)
                self.runner.release(seq.request_id)
            if seq.is_finished:
                del self.requests[seq.request_id]
            if state.parent is not None:
                parents[state.parent.request_id] = state.parent
                continue
            outputs.append(state.make_output(self.kv_connector.request_stats(seq)))
            if seq.is_finished:
                self.kv_connector.request_finished(seq.request_id)
                self.auditor.request_finished(seq.request_id)
        for parent in parents.values():
            first = parent.states[0].seq
            outputs.append(parent.make_output(self.kv_connector.request_stats(first)))
            if parent.finished:
                del self.parents[parent.request_id]
                self.kv_connector.request_finished(parent.request_id)
                self.auditor.request_finished(parent.request_id)
        return outputs

    def blend_audit_records(self) -> list:
        """The blend audits landed so far, oldest first (:mod:`blendkv.guards.audit`)."""
        return list(self.auditor.records)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.precomputing),
            num_kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            num_kv_blocks=bm.num_blocks,
            last_step_num_scheduled=self._last_step_num_scheduled,
            num_generated_tokens=self._num_generated_tokens,
            num_precomputing=len(self.scheduler.precomputing),
        )

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        for seq in self.scheduler.running:
            assert seq.status == SequenceStatus.RUNNING
        for seq in self.scheduler.precomputing:
            assert seq.status == SequenceStatus.PRECOMPUTING and not seq.block_table
            assert len(seq.block_table) * self.info.block_size >= seq.num_computed_tokens
