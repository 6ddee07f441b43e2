"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own (no globals).

Three sources:

* the HTTP layer: requests by route and status (:meth:`ServerMetrics.observe_http`);
* the engine thread, after every step (:meth:`ServerMetrics.on_step`, an ``AsyncLLM`` step
  listener): tokens in/out, TTFT and end-to-end latency, blend counters, and how many requests
  received a token in the step (the continuous batch at work), and the blend audits that
  landed (first-token KL and top-1 agreement histograms; ``blendkv.guards.audit``) and, per
  fidelity target, the ratio the fidelity controller runs it at and its audited p90
  (``blendkv.guards.fidelity_controller``);
* the engine's published :class:`~blendkv.entrypoints.async_llm.EngineStats`, read at scrape
  time: running/waiting requests, KV blocks used, steps, aborts.

The first tokens and audits also go to a bounded window of samples (:mod:`.health_log`) that
``GET /v1/blendkv/health`` and the ``/ui`` page read: exact recent percentiles, points to plot.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from blendkv.entrypoints.async_llm import AsyncLLM
from blendkv.entrypoints.openai.health_log import HealthLog
from blendkv.guards.audit import DEFAULT_WARN_KL, AuditWatch
from blendkv.loading.controller import MeanEstimate
from blendkv.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_KL_BUCKETS = (1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1, 3)
# Blend stats fields -> counter name suffix and help.
_BLEND = {
    "chunks_hit": "chunks whose K/V was found in the store",
    "chunks_on_device": "of the chunks hit, those read from device memory (kv_device_cache_bytes)",
    "chunks_in_memory": "of the chunks hit, those read from host memory (the memory tier)",
    "chunks_missed": "chunks computed at query time (then written to the store)",
    "tokens_reused": "chunk tokens whose stored K/V was loaded",
    "tokens_recomputed": "prompt tokens recomputed through the last layer",
    "load_seconds": "seconds spent loading stored K/V into KV blocks",
}


class ServerMetrics:
    def __init__(self, blend_audit_warn_kl: float = DEFAULT_WARN_KL) -> None:
        r = self.registry = CollectorRegistry()
        self._auditor = None
        self._fidelity = None  # the engine's FidelityController
        self._audit_warn_kl = blend_audit_warn_kl
        self.audit_watch = None
        self.health = HealthLog()  # the recent window, for /v1/blendkv/health and /ui
        self.ttft_mean = MeanEstimate()  # what a Ray Serve replica reports as its prefill_s
        # Declared in this order, /metrics' order.
        self._declare_audit_metrics(r)
        self._declare_request_metrics(r)
        self._declare_blend_metrics(r)

    def _declare_audit_metrics(self, r: CollectorRegistry) -> None:
        """The blend audits (first-token KL, top-1 agreement) and, per fidelity target, the
        ratio its requests run at and their audited p90."""
        self.audit_kl = Histogram(
            "blendkv_blend_audit_kl",
            "Audited blends: first-token KL(full prefill || blend), nats",
            buckets=_KL_BUCKETS,
            registry=r,
        )
        self.audit_top1 = Histogram(
            "blendkv_blend_audit_top1_agreement",
            "Audited blends: 1 when the first token's argmax equals full prefill's, else 0",
            buckets=(0.5,),
            registry=r,
        )
        self.target_ratio = Gauge(
            "blendkv_fidelity_target_recompute_ratio",
            "Per fidelity target (nats): the recompute ratio its requests run at now",
            ["target"],
            registry=r,
        )
        self.target_p90 = Gauge(
            "blendkv_fidelity_target_audit_p90",
            "Per fidelity target (nats): p90 of the audited divergence at that ratio, nats",
            ["target"],
            registry=r,
        )

    def _declare_request_metrics(self, r: CollectorRegistry) -> None:
        """HTTP requests, TTFT and end-to-end latency, prompt tokens, finish reasons, and the
        requests served per step."""
        self.http_requests = Counter(
            "blendkv_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "blendkv_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "blendkv_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "blendkv_prompt_tokens", "Prompt tokens of requests that got a first token", registry=r
        )
        self.finished = Counter(
            "blendkv_requests_finished",
            "Finished requests by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.step_requests = Histogram(
            "blendkv_step_requests",
            "Requests that received a token in one engine step",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )

    def _declare_blend_metrics(self, r: CollectorRegistry) -> None:
        """Blended requests and their blend stats (``_BLEND``), summed."""
        self.blend_requests = Counter(
            "blendkv_blend_requests", "Blended requests that got a first token", registry=r
        )
        self.blend = {n: Counter(f"blendkv_blend_{n}", h, registry=r) for n, h in _BLEND.items()}

    def attach(self, engine: AsyncLLM) -> None:
        """Observe ``engine``'s steps and export its stats (once, when the model is loaded)."""
        engine.add_step_listener(self.on_step)
        self._auditor = engine.llm.engine.auditor
        self._fidelity = engine.llm.engine.fidelity
        self.audit_watch = AuditWatch(self._audit_warn_kl)
        self.registry.register(_EngineCollector(engine))

    def observe_http(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def on_step(self, outputs: list[RequestOutput]) -> None:
        """Engine thread, after each step: every output is a request with a new token (one
        per sample that got one; generated tokens are counted by the engine)."""
        if outputs:
            self.step_requests.observe(len(outputs))
        if self._auditor is not None:
            for record in self._auditor.take_new_records():
                self.audit_kl.observe(record.kl)
                self.audit_top1.observe(1.0 if record.top1_agree else 0.0)
                self.audit_watch.observe(record)
                self.health.on_audit(record)
        if self._fidelity is not None:  # read here: the engine's thread changes it
            self._observe_targets()
        for out in outputs:
            m = out.metrics
            if len(out.outputs[0].token_ids) == 1:  # the request's first token
                self.health.on_first_token(out)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if m.ttft is not None:
                    self.ttft.observe(m.ttft)
                    self.ttft_mean.update(m.ttft)
                if out.blend_stats is not None:
                    self.blend_requests.inc()
                    stats = out.blend_stats
                    for name, counter in self.blend.items():
                        counter.inc(getattr(stats, name))
            if out.finished:
                self.finished.labels(out.outputs[0].finish_reason or "unknown").inc()
                if m.e2e_latency is not None:
                    self.e2e.observe(m.e2e_latency)

    def _observe_targets(self) -> None:
        for target, control in self._fidelity.state().items():
            self.target_ratio.labels(f"{target:g}").set(control.ratio)
            if control.p90 is not None:
                self.target_p90.labels(f"{target:g}").set(control.p90)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters read from the engine's last published stats at scrape time."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        for name, help, value in (
            ("blendkv_num_requests_running", "Requests in the running batch", s.num_running),
            ("blendkv_num_requests_waiting", "Requests waiting for admission", s.num_waiting),
            ("blendkv_kv_blocks_used", "KV blocks held by requests", s.num_kv_blocks_used),
            ("blendkv_kv_blocks_total", "KV blocks in the pool", s.num_kv_blocks),
            (
                "blendkv_max_step_requests",
                "Most requests that received a token in one step",
                s.max_step_requests,
            ),
        ):
            yield GaugeMetricFamily(name, help, value=value)
        yield CounterMetricFamily("blendkv_engine_steps", "Engine steps", value=s.num_steps)
        yield CounterMetricFamily(
            "blendkv_generation_tokens", "Generated tokens", value=s.num_generated_tokens
        )
        yield CounterMetricFamily(
            "blendkv_requests_aborted", "Requests aborted (client gone)", value=s.num_aborted
        )
