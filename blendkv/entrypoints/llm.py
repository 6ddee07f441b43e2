"""``LLM``: the offline, vLLM-shaped entry point (``generate``, ``chat``, ``stream``).

Thread-safe: the engine is single-threaded, so every engine call holds one lock, and callers
waiting for outputs step the engine cooperatively (:meth:`LLM._wait_for`): one thread at a time
runs a step for *every* queued request and routes each output to its own request's sink, the
others wait for that step to end and then look at their sinks.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from blendkv.connector.prompt import apply_template
from blendkv.engine.llm_engine import LLMEngine
from blendkv.engine_args import create_engine_config
from blendkv.entrypoints.router import OutputRouter
from blendkv.entrypoints.warmup import warm_up
from blendkv.errors import ConfigError, InvalidRequestError
from blendkv.outputs import RequestOutput
from blendkv.sampling_params import SamplingParams
from blendkv.text import replace_lone_surrogates

PRECOMPUTE_BATCH = 8  # chunks per store transaction (LLM.precompute_chunks)

Prompt = Any  # str | list[int] | dict (blended prompt, see blendkv.blend)
Message = dict[str, str]


class LLM:
    """A model plus a paged, continuously batched engine.

    ``LLM()`` serves the embedded SmolLM2-135M-Instruct; ``model`` also takes a local HF
    directory (config.json + safetensors) or a GGUF file. Every keyword of
    :class:`~blendkv.config.EngineConfig` is accepted (``dtype``, ``block_size``,
    ``num_kv_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
    ``enable_prefix_caching``, ...), and so is every one of the blend connector's
    :class:`~blendkv.connector.config.BlendConnectorConfig` (``kv_store_dir``,
    ``prefetch_kv``, ...), and vLLM's names where they mean something here
    (``gpu_memory_utilization``, ``tensor_parallel_size=1``, ...:
    :func:`~blendkv.engine_args.from_vllm_names`); any other
    raises :class:`~blendkv.errors.ConfigError`.

    A short warm-up request runs at load (:mod:`blendkv.entrypoints.warmup`), so the first
    request does not pay the process's one-time costs; ``warmup=False`` skips it.

    One ``LLM`` may be shared by threads: ``generate``, ``stream`` and ``chat`` calls from
    several threads are batched together in one engine loop, each getting its own outputs.

    Attributes:
        config: the :class:`~blendkv.config.EngineConfig` it was built with.
        engine: the ``LLMEngine`` it steps (:mod:`blendkv.engine.llm_engine`).
        start_gate: the blend start gate's result (``blend_start_gate``): whether a blend at
            ratio 1.0 reproduced full prefill at load; None when the gate did not run.
    """

    def __init__(self, model: str | None = None, *, warmup: bool = True, **kwargs: Any) -> None:
        self.config = create_engine_config(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        if warmup:  # the first request's TTFT is then its own
            warm_up(self.engine)
        from blendkv.guards.start_gate import gate_at_start  # not at import: blendkv.blend

        self.start_gate = gate_at_start(self.engine)  # blend@1.0 is full prefill, or no blending
        # Every step's outputs go to their own request's consumer: interleaved streams (and a
        # generate call between two stream items) never lose each other's tokens.
        self._router = OutputRouter()
        # _engine_lock: held around every engine call (add, step, abort, close, a model call
        # outside the loop). _step_done: guards _stepping, "some thread is running a step",
        # and wakes the waiters when that step's outputs are routed.
        self._engine_lock = threading.RLock()
        self._step_done = threading.Condition()
        self._stepping = False

    @property
    def tokenizer(self):
        """The model's tokenizer (a transformers tokenizer)."""
        return self.engine.tokenizer

    def blend_manager(self):
        """The chunk-KV store and blended-prompt machinery of the blend KV connector
        (:class:`~blendkv.connector.manager.BlendManager`), created on first use."""
        # The connector is a plugin loaded by name: importing blendkv does not load it.
        from blendkv.connector.blend_connector import BlendConnector

        conn = self.engine.kv_connector
        if not isinstance(conn, BlendConnector):
            raise ConfigError(
                f"this LLM's kv_connector is {self.config.kv_connector!r}, not 'blend'"
            )
        return conn.manager

    def precompute_chunks(
        self,
        chunks: list[list[int]],
        *,
        contexts: list[list[int]] | None = None,
        texts: list[str] | None = None,
        doc_id: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list:
        """Compute and store the K/V of the chunks (token id lists) the blend connector's
        document store lacks: each prefilled alone behind its context (default: the store's
        anchor, as ingest stores it), ``PRECOMPUTE_BATCH`` chunks per store transaction.
        Returns a ``PutResult`` per chunk (None: already stored); ``progress(n)`` counts the
        chunks done."""
        manager = self.blend_manager()
        keys, todo = manager.missing_chunks(chunks, contexts)
        contexts = contexts or [manager.store_anchor_ids] * len(chunks)
        results: list = [None] * len(chunks)
        if progress is not None and len(todo) < len(chunks):
            progress(len(chunks) - len(todo))
        for start in range(0, len(todo), PRECOMPUTE_BATCH):
            batch = todo[start : start + PRECOMPUTE_BATCH]
            with self.exclusive():  # the model is the engine's: not during a step
                kvs = self.engine.runner.compute_chunk_kv(
                    [contexts[i] for i in batch], [chunks[i] for i in batch]
                )
            put = manager.store_chunks(
                [keys[i] for i in batch],
                [chunks[i] for i in batch],
                kvs,
                texts=None if texts is None else [texts[i] for i in batch],
                doc_id=doc_id,
                positions=batch,
            )
            for i, result in zip(batch, put, strict=True):
                results[i] = result
            if progress is not None:
                progress(len(batch))
        return results

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine between steps, for a model call outside the engine loop (the chunk
        K/V an ingest computes): no step runs, and no request is added, until it exits."""
        with self._engine_lock:
            yield

    # ------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        verify: bool = False,
        **request_kwargs: Any,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in the order of ``prompts``.

        All requests are validated before any is queued: a bad one raises and nothing runs.

        Args:
            prompts: one prompt or a list. A prompt is a string, a list of token ids, or a
                blended prompt: a dict with ``documents`` (strings), ``chunks`` (token id
                lists) or ``chunk_ids`` (stored chunks), and a ``query``; optionally
                ``system`` and ``instruction`` (:mod:`blendkv.connector.prompt`).
            sampling_params: one for all prompts or one per prompt; None:
                ``SamplingParams()`` (temperature 1, at most 16 tokens).
            use_tqdm: show a progress bar over the prompts.
            verify: after the answers, check each blended one against full prefill of its
                prompt tokens (:mod:`blendkv.guards.verify`; ``blend_stats.verification``).
            **request_kwargs: go to every request: ``blend``: the
                :class:`~blendkv.blend.config.BlendConfig` of the blended prompts (None: the
                default, and the engine's cost check may choose); ``token_map=True``: each
                output's ``blend_stats.token_map`` says how every prompt token was computed;
                ``logits_from``: return the prompt's logits from that position on
                (``RequestOutput.extra``).

        Returns:
            One finished :class:`~blendkv.outputs.RequestOutput` per prompt.
        """
        outputs = self._generate(prompts, sampling_params, use_tqdm, **request_kwargs)
        if verify:
            self._verify(self._as_list(prompts), outputs, sampling_params, request_kwargs)
        return outputs

    def _verify(self, prompts, outputs, sampling_params, request_kwargs) -> None:
        from blendkv.guards.verify import verify

        params = self._params_list(sampling_params, len(prompts))
        for prompt, out, p in zip(prompts, outputs, params, strict=True):
            if isinstance(prompt, dict) and out.blend_stats is not None:
                max_tokens = p.max_tokens if p.max_tokens is not None else 32
                blend = request_kwargs.get("blend")
                out.blend_stats.verification = verify(self, prompt, out, blend, max_tokens)

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        **request_kwargs: Any,
    ) -> list[RequestOutput]:
        prompts = self._as_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        finished: dict[str, RequestOutput] = {}  # written by whichever thread steps

        def keep_final(out: RequestOutput) -> None:
            if out.finished:
                finished[out.request_id] = out

        request_ids = self._add_all(prompts, params, keep_final, **request_kwargs)
        bar = _progress(len(prompts), use_tqdm)

        try:
            while len(finished) < len(request_ids):
                seen = len(finished)
                if not self._wait_for(lambda seen=seen: len(finished) > seen):
                    break  # aborted from outside
                bar.update(len(finished) - seen)
        except BaseException:
            self._abort([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, **request_kwargs: Any
    ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` per new token; ``out.delta_text`` is the new text (with
        ``n > 1``, each of ``out.outputs`` has its own ``delta_text``).

        Other queued requests keep running in the same batches, and their outputs are kept for
        their own consumers: several ``stream`` iterators (and ``generate`` calls) may be
        interleaved on one thread, or consumed on several. Closing the iterator early aborts
        the request.
        """
        pending: deque[RequestOutput] = deque()  # appended by whichever thread steps
        [request_id] = self._add_all([prompt], [sampling_params], pending.append, **request_kwargs)
        done = False
        try:
            while not done:
                if not pending and not self._wait_for(lambda: bool(pending)):
                    return  # aborted from outside
                out = pending.popleft()
                done = out.finished
                yield out
        finally:
            if not done:
                self._abort([request_id])

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's chat template."""
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'}")
        messages = [
            {**m, "content": replace_lone_surrogates(m["content"], f"message {i} content")}
            if isinstance(m.get("content"), str)
            else m
            for i, m in enumerate(messages)
        ]
        ids = apply_template(
            self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def blend_audit_records(self) -> list:
        """The blend audits so far (``blend_audit_rate``; :mod:`blendkv.guards.audit`), oldest
        first. Audits still pending run first: they wait for an idle engine."""
        auditor = self.engine.auditor
        self._wait_for(lambda: not auditor.has_work())
        return self.engine.blend_audit_records()

    # -------------------------------------------------------------- helpers
    def close(self) -> None:
        """Release the chunk-KV store (a private temporary store is deleted)."""
        with self._engine_lock:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_all(self, prompts, params, sink, **request_kwargs) -> list[str]:
        """Validate every request, then queue them all with ``sink`` as their consumer; a bad
        request raises in its caller's thread before anything is queued."""
        engine = self.engine
        with self._engine_lock:
            prepared = []
            for prompt, p in zip(prompts, params, strict=True):
                prepared.append(engine.prepare_request(prompt, p, **request_kwargs))
            request_ids: list[str] = []
            try:
                for req in prepared:
                    request_ids.append(rid := engine.add_prepared(req))
                    self._router.register(rid, sink)  # no step runs before it is registered
            except BaseException:
                self._abort(request_ids)
                raise
            return request_ids

    def _abort(self, request_ids: list[str]) -> None:
        with self._engine_lock:
            for rid in request_ids:
                self._router.unregister(rid)
                self.engine.abort_request(rid)

    def _wait_for(self, ready: Callable[[], bool]) -> bool:
        """Step the engine until ``ready()``; False if the engine ran out of requests first.

        Cooperative stepping: while another thread runs a step, wait for it to end (its
        outputs may be the ones awaited); otherwise run one step for every queued request
        and route all outputs to their sinks.
        """
        while True:
            with self._step_done:
                while self._stepping and not ready():
                    self._step_done.wait()
                if ready():
                    return True
                self._stepping = True
            try:
                with self._engine_lock:
                    if not self.engine.has_unfinished_requests():
                        return ready()
                    self._router.route(self.engine.step())
            finally:
                with self._step_done:
                    self._stepping = False
                    self._step_done.notify_all()

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            return [prompts]  # a single prompt given as token ids
        if not prompts:
            raise InvalidRequestError("no prompts given")
        return prompts

    @staticmethod
    def _params_list(params, n: int) -> list:
        if params is None or isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts")
        return params


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", disable=not enabled, unit="req")
