"""The evaluation loop: load examples, warm the chunk store, run every method on every example.

    load + render  ->  warm-up (one untimed request per method)  ->  for each example: its
    documents' K/V stored (untimed), every method in turn (timed, interleaved), each followed
    by its teacher-forced logits along full prefill's answer  ->  journal  ->  aggregate

Interleaving methods per example makes slow drift of a shared machine hit all methods alike;
the warm-up and the per-example store keep chunk precompute and first-call costs out of TTFT.
Each example's chunks are stored just before it runs: the run's private store is bounded
(a few GB) and would evict a whole run's chunks stored up front. ``full`` is the reference
for every fidelity metric, so it always runs (first), even when not asked for. Examples already
in the journal (``blendkv eval --resume``) are not run again.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm.auto import tqdm

from blendkv import LLM, SamplingParams
from blendkv.blend.config import DEFAULT_TARGET, BlendConfig
from blendkv.errors import ConfigError
from blendkv.eval import metrics
from blendkv.eval.codecs import CodecStores, codec_variants, parse_codecs
from blendkv.eval.datasets import dataset_kind, load_dataset
from blendkv.eval.journal import Journal
from blendkv.eval.methods import (
    ExamplePrompt,
    HFRunner,
    Method,
    MethodError,
    MethodRun,
    parse_methods,
    run_method,
    teacher_forced_rows,
)
from blendkv.eval.ordering import order_examples
from blendkv.eval.prompts import get_prompt_spec, render_prompt
from blendkv.eval.reference_cache import ReferenceCache, reference_identity
from blendkv.guards.calibration import UNCALIBRATED_RATIO
from blendkv.rag.chunk_order import check_chunk_order

__all__ = ["EvalConfig", "EvalResult", "run_eval", "summarize_method"]

# What `--calibrate N` measures (EvalConfig.calibrate_on).
CALIBRATE_ON = ("passages", "questions")


# What chunks are precomputed behind, after the chat template's prefix: nothing more
# ("template"), an instruction that is not the prompt's ("generic"), or the prompt's own
# instruction, i.e. the exact prefix the chunks follow in the prompt ("prompt").
ANCHORS = ("prompt", "template", "generic")
GENERIC_INSTRUCTION = "Use the following documents to answer the user's question.\n"
# The fidelity target (nats) the report holds a method without its own (fixed ratios, reuse)
# to, unless ``--fidelity-target`` gives one: the engine's default target, so ``default`` and
# the fixed ratios are scored against the same bound.
REPORT_TARGET = DEFAULT_TARGET


def anchor_instruction(anchor: str, prompt_system: str) -> str | None:
    """The ``anchor_instruction`` of the engine for ``anchor`` (see :data:`ANCHORS`)."""
    return {"prompt": prompt_system, "template": None, "generic": GENERIC_INSTRUCTION}[anchor]


@dataclass(frozen=True)
class EvalConfig:
    """What ``blendkv eval`` runs. ``answer_tokens``: how much of full prefill's greedy answer
    the teacher-forced fidelity follows (tokens)."""

    data: str
    methods: str = "full,reuse,blend@0.15"
    limit: int | None = None
    offset: int = 0  # examples skipped before the first one evaluated
    model: str | None = None
    dtype: str = "auto"
    max_tokens: int = 32
    seed: int = 0
    answer_tokens: int = 16
    max_model_len: int | None = None
    kv_store_dir: str | None = None
    device: str = "auto"
    attention_backend: str = "auto"
    # What every chunk is precomputed behind (see ANCHORS), and how many tokens of the chunk
    # before it in the prompt are added (EngineConfig.anchor_boundary_tokens).
    anchor: str = "prompt"
    anchor_boundary: int = 0
    # Passage order in the prompt (blendkv.eval.ordering): the data set's, or ranked by the
    # pipeline's embedder with the best passage first or last.
    chunk_order: str = "source"
    # Stored-K/V codecs (blendkv.eval.codecs): reuse/blend methods run once per codec.
    kv_codecs: str = "none"
    # Full prefill's answers and logits per prompt, kept across runs (blendkv.eval.reference_cache).
    reference_cache: str | None = None
    # Nats: the report's "within target" holds every method to it; None: target@T methods to
    # their own T, the others to REPORT_TARGET (see target_for).
    fidelity_target: float | None = None
    # Calibrate the run's store for target@T methods first, on this many prompts (0: none).
    calibrate: int = 0
    # What those prompts are: random sets of the first examples' passages with the
    # calibration's own questions ("passages"), or those examples' own prompts, each with its
    # question ("questions", as `blendkv calibrate --questions` measures a query log).
    calibrate_on: str = "passages"

    def __post_init__(self) -> None:
        for name in ("max_tokens", "answer_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < 0:
            raise ConfigError(f"offset must be >= 0, got {self.offset!r}")
        c = self.calibrate
        if isinstance(c, bool) or not isinstance(c, int) or c < 0 or c == 1:
            raise ConfigError(f"calibrate must be 0 (none) or at least 2 prompts, got {c!r}")
        if self.calibrate_on not in CALIBRATE_ON:
            raise ConfigError(
                f"calibrate_on must be one of {', '.join(CALIBRATE_ON)}, got {self.calibrate_on!r}"
            )
        if self.anchor not in ANCHORS:
            raise ConfigError(f"anchor must be one of {', '.join(ANCHORS)}, got {self.anchor!r}")
        if isinstance(self.anchor_boundary, bool) or self.anchor_boundary < 0:
            raise ConfigError(f"anchor_boundary must be >= 0, got {self.anchor_boundary!r}")
        check_chunk_order(self.chunk_order)
        t = self.fidelity_target
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < math.inf
        ):
            raise ConfigError(f"fidelity_target must be a finite number of nats >= 0, got {t!r}")
        parse_codecs(self.kv_codecs)
        if "[" in self.methods:
            raise ConfigError("a method name takes no [codec]: list codecs with --kv-codec")
        parse_methods(self.methods)  # raise MethodError now, before any model loads

    @property
    def method_list(self) -> list[Method]:
        methods = parse_methods(self.methods)
        if all(m.name != "full" for m in methods):
            methods.insert(0, parse_methods("full")[0])  # the fidelity reference
        return sorted(methods, key=lambda m: m.name != "full")  # full first

    def target_for(self, method: Method) -> float:
        """The fidelity target (nats) ``method``'s "within target" fraction is counted against:
        ``fidelity_target`` when given, else the method's own (``target@T``), else
        :data:`REPORT_TARGET`."""
        if self.fidelity_target is not None:
            return float(self.fidelity_target)
        own = method.fidelity_target
        return REPORT_TARGET if own is None else own

    @property
    def variants(self) -> list[tuple[Method, str]]:
        """``(method, codec)`` runs: :attr:`method_list` on ``none``, then ``METHOD[codec]``."""
        return codec_variants(self.method_list, parse_codecs(self.kv_codecs))


@dataclass
class EvalResult:
    config: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)  # one per (example, method)
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)  # method -> aggregates


def run_eval(config: EvalConfig, progress: bool = True, journal: Journal | None = None):
    """Run every method on every example; with a ``journal``, examples it holds are skipped
    (their records join the result) and each finished example is appended to it."""
    methods = config.method_list
    examples = load_dataset(config.data, config.limit, config.seed, config.offset)
    if not examples:
        raise MethodError(f"{config.data}: no examples to evaluate")
    wanted = {ex.id for ex in examples}
    done = [r for r in journal.records if r["id"] in wanted] if journal else []
    done_ids = {r["id"] for r in done}
    todo = [ex for ex in examples if ex.id not in done_ids]
    if todo or journal is None or journal.run_config is None:
        # calibrated on the first examples of the whole run, a resumed one included
        calibration = examples[: config.calibrate]
        result = _run_examples(config, methods, todo, calibration, len(examples), progress, journal)
    else:  # everything is in the journal: aggregate only, no model
        result = EvalResult(config={**journal.run_config, "num_examples": len(examples)})
    result.records[:0] = done
    for m, _ in config.variants:
        rows = [r for r in result.records if r["method"] == m.name]
        result.summary[m.name] = summarize_method(rows, config.target_for(m))
    _add_speedups(result.summary)
    return result


def _run_examples(config, methods, examples, calibration, num_examples, progress, journal):
    """``examples`` run (the run's, less those in the journal); ``calibration``: the examples
    whose passages ``--calibrate`` measures (the run's first)."""
    spec = get_prompt_spec(dataset_kind(config.data))
    examples = order_examples(examples, config.chunk_order)
    llm = LLM(
        config.model,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        kv_store_dir=config.kv_store_dir,
        device=config.device,
        attention_backend=config.attention_backend,
        anchor_instruction=anchor_instruction(config.anchor, spec.system),
        anchor_boundary_tokens=config.anchor_boundary,
    )
    stores = None
    try:
        manager = llm.blend_manager()
        stores = CodecStores(manager, parse_codecs(config.kv_codecs))
        prompts = [_example_prompt(manager, render_prompt(ex, spec)) for ex in examples]
        hf = _hf_runner(llm) if any(m.kind == "hf" for m in methods) else None
        result = EvalResult(config=_config_dict(config, llm, methods, num_examples))
        reference = None
        if config.reference_cache is not None:
            identity = reference_identity(llm, config.max_tokens, config.answer_tokens)
            reference = ReferenceCache(config.reference_cache, identity)
        if examples and config.calibrate:  # before a target@T request reads the calibration
            measured = [_example_prompt(manager, render_prompt(ex, spec)) for ex in calibration]
            resumed = journal.run_config if journal is not None else None
            curve = _calibrate(llm, stores, measured, config, progress, resumed)
            result.config["calibration"] = curve
        targets = [m.name for m in methods if m.fidelity_target is not None]
        if targets and manager.calibration() is None:
            print(
                f"note: the run's store has no calibration: {', '.join(targets)} run at ratio "
                f"{UNCALIBRATED_RATIO:g} (--calibrate N measures one first)",
                file=sys.stderr,
            )
        if journal is not None:
            journal.start(result.config)
        if not examples:
            return result
        _warm_up(llm, hf, methods, stores, prompts[0])
        keys, num_tokens = _store_chunks(llm, stores, prompts[0])
        result.config["store_bytes_per_token"] = {
            c: stores.bytes_per_token(c, keys, num_tokens) for c in stores.codecs
        }  # (the first example's chunks)
        params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0)
        bar = tqdm(list(zip(examples, prompts, strict=True)), desc="eval", disable=not progress)
        variants = config.variants
        for ex, prompt in bar:
            _store_chunks(llm, stores, prompt)  # untimed: every chunk is a hit in the timed runs
            runs, rows, cached = _run_example(
                llm, hf, variants, stores, prompt, params, config.answer_tokens, reference
            )
            records = _score_example([m for m, _ in variants], ex, prompt, runs, rows, config)
            for r in records:
                r["reference_cached"] = cached
            if journal is not None:
                journal.append(records)
            result.records.extend(records)
            bar.set_postfix({m: f"{r.ttft:.2f}s" for m, r in runs.items()})
        if reference is not None:
            result.config["reference_cache_hits"] = reference.hits
        return result
    finally:
        if stores is not None:
            stores.close()
        llm.close()


def _hf_runner(llm) -> HFRunner:
    """transformers on the engine's model, dtype and device (the ``hf`` methods)."""
    engine = llm.engine
    return HFRunner(
        engine.resolved.model_dir,
        engine.dtype,
        engine.tokenizer,
        engine.info.eos_token_ids,
        engine.info.device,
    )


def _store_chunks(llm, stores: CodecStores, prompt: ExamplePrompt) -> tuple[list[bytes], int]:
    """Stores ``prompt``'s chunks not stored yet, in the engine's store and every codec's
    (each encodes them its way); returns their keys and token count."""
    state = stores.manager.prepare(prompt.blended, None)
    llm.precompute_chunks(state.prompt.chunks, contexts=state.chunk_contexts)
    stores.fill(state.chunk_keys)
    return state.chunk_keys, sum(len(c) for c in state.prompt.chunks)


def _calibrate(llm, stores: CodecStores, prompts, config: EvalConfig, progress: bool, resumed):
    """Calibrate the run's store (:mod:`blendkv.guards.calibration`) on ``config.calibrate``
    random sets of the stored passages of ``prompts`` (the run's first examples), each followed
    by one of the calibration's own questions (not the data set's), or with ``calibrate_on``
    "questions" on ``prompts`` themselves, and save it beside the store: what ``target@T``
    methods pick their ratio from. Returns the curve, for results.json. A resumed run
    (``resumed``: the journal's config) whose curve is still the one beside the store keeps it:
    its earlier records ran with that curve."""
    from blendkv.guards.calibration import (
        CONFIDENT_PROMPTS,
        calibrate,
        calibrate_prompts,
        few_prompts_note,
    )

    manager = stores.manager
    saved = manager.calibration()
    if resumed and saved is not None and resumed.get("calibration") == _curve_dict(saved):
        return _curve_dict(saved)
    keys: set[bytes] = set()
    for prompt in tqdm(prompts, desc="storing passages", unit="example", disable=not progress):
        keys.update(_store_chunks(llm, stores, prompt)[0])
    ids = [m.chunk_id for m in manager.document_store.iter_meta() if m.key in keys]
    # prompts as long as the run's: drift grows with the passages a prompt holds
    per_prompt = round(statistics.median(len(p.blended["documents"]) for p in prompts))
    with tqdm(total=config.calibrate, desc="calibrating", disable=not progress) as bar:
        if config.calibrate_on == "questions":
            blended = [p.blended for p in prompts]
            curve = calibrate_prompts(llm, blended, seed=config.seed, progress=bar.update)
        else:
            curve = calibrate(
                llm,
                ids,
                prompts[0].blended["instruction"],
                num_prompts=config.calibrate,
                chunks_per_prompt=max(1, per_prompt),
                seed=config.seed,
                progress=bar.update,
            )
    manager.save_calibration(curve)
    if curve.num_prompts < CONFIDENT_PROMPTS:
        print(few_prompts_note(curve.num_prompts), file=sys.stderr)
    return _curve_dict(curve)


def _curve_dict(curve) -> dict:
    """A calibration as results.json and the journal hold it (JSON types, no fingerprint)."""
    return json.loads(json.dumps({k: v for k, v in asdict(curve).items() if k != "fingerprint"}))


def _example_prompt(manager, rendered) -> ExamplePrompt:
    blended = {"documents": rendered.documents, "query": rendered.query}
    blended["instruction"] = rendered.system
    ids = manager.prepare(blended, BlendConfig()).prompt.token_ids
    rev = manager.prepare({**blended, "documents": rendered.documents[::-1]}, BlendConfig())
    return ExamplePrompt(blended, list(ids), list(rev.prompt.token_ids))


def _warm_up(llm, hf, methods: list[Method], stores: CodecStores, first: ExamplePrompt) -> None:
    """Each method once, untimed, on a prompt of ``first``'s first document (first calls:
    kernels, allocator, caches)."""
    small = {**first.blended, "documents": first.blended["documents"][:1]}
    ids = llm.blend_manager().prepare(small, None).prompt.token_ids
    tiny = ExamplePrompt(small, list(ids), list(ids))
    _store_chunks(llm, stores, tiny)
    for m in methods:
        run_method(llm, hf, m, tiny, SamplingParams(max_tokens=2))


def _run_example(llm, hf, variants, stores, prompt, params, answer_tokens: int, reference=None):
    """Every method's timed run (on each codec's store), each followed at once by its
    teacher-forced logits along full prefill's answer (``full`` runs first), so that request
    reuses the run's own prompt K/V. With a ``reference`` cache holding this prompt, full
    prefill is read from it instead of run (the third value says so)."""
    runs: dict[str, MethodRun] = {}
    rows: dict[str, Any] = {}
    cached = False
    for m, codec in variants:
        if m.kind == "full" and reference is not None:
            hit = reference.get(prompt.token_ids)
            if hit is not None:
                runs[m.name], rows[m.name] = hit
                cached = True
                continue
        with stores.using(codec):
            runs[m.name] = run_method(llm, hf, m, prompt, params)
            answer = runs["full"].token_ids[:answer_tokens]
            if m.kind == "prefix":  # exact K/V of the same tokens: full's (teacher_forced_rows)
                rows[m.name] = rows["full"]
            else:
                rows[m.name] = teacher_forced_rows(llm, hf, m, prompt, answer).rows
        if m.kind == "full" and reference is not None:
            reference.put(prompt.token_ids, runs[m.name], rows[m.name])
    return runs, rows, cached


def _score_example(methods, ex, prompt, runs: dict[str, MethodRun], rows_of, config):
    full = runs["full"]
    answer = full.token_ids[: config.answer_tokens]
    ref = rows_of["full"]
    records = []
    for m in methods:
        run = runs[m.name]
        same = m.kind in ("full", "prefix")  # see teacher_forced_rows
        rows = rows_of[m.name]
        k = len(answer)
        fid = metrics.teacher_forced_fidelity(ref[:k], rows[:k], config.answer_tokens)
        # what a fidelity target bounds: the largest KL over the answer's first 16 tokens
        divergence = metrics.answer_divergence(ref[:k], rows[:k])
        pred = metrics.first_line(run.text)
        stats = run.blend_stats or {}
        n_prompt = len(prompt.token_ids)
        ratio = None  # the ratio the blend ran at: the engine's pick for target@T
        if m.kind == "blend":
            ratio = stats.get("chosen_recompute_ratio")
            ratio = m.blend.recompute_ratio if ratio is None else ratio
            recompute = stats["recompute_fraction"]
            computed = stats["tokens_recomputed"] / n_prompt
            cost = stats["compute_fraction"]
        else:
            recompute = computed = cost = (n_prompt - run.num_cached_tokens) / n_prompt
        records.append(
            {
                "id": ex.id,
                "method": m.name,
                "prediction": pred,
                "generation": run.text,
                "answers": ex.answers,
                "f1": metrics.f1_score(pred, ex.answers),
                "em": metrics.exact_match(pred, ex.answers),
                "rouge_l": metrics.rouge_l(pred, ex.answers),
                "first_token_agreement": float(metrics.first_token_agreement(ref[0], rows[0])),
                "first_token_kl": float(metrics.kl_divergence(ref[0], rows[0])),
                "answer_kl": fid.mean_kl,
                "answer_agreement": fid.top1_agreement,
                "answer_max_kl": divergence,
                "continuation_match": float(run.token_ids == full.token_ids),
                "ttft_s": run.ttft,
                "ttft_speedup": full.ttft / run.ttft,
                "num_prompt_tokens": n_prompt,
                "num_cached_tokens": run.num_cached_tokens,
                "recompute_ratio": ratio,
                "recompute_fraction": recompute,
                "computed_fraction": computed,
                "compute_fraction": cost,
                "kv_bytes_loaded": stats.get("kv_bytes_loaded", 0),
                "load_seconds": stats.get("load_seconds", 0.0),
                "blend_stats": run.blend_stats,
                "fidelity_rows": "full" if same else m.name,
            }
        )
    return records


_MEANS = (
    "f1",
    "em",
    "rouge_l",
    "first_token_agreement",
    "first_token_kl",
    "answer_kl",
    "answer_agreement",
    "answer_max_kl",
    "continuation_match",
    "recompute_fraction",
    "computed_fraction",
    "compute_fraction",
    "kv_bytes_loaded",
    "load_seconds",
)


def summarize_method(
    records: list[dict[str, Any]], fidelity_target: float = REPORT_TARGET
) -> dict[str, Any]:
    """Aggregates of one method's per-example records: means, TTFT median/p90/mean, the
    median of the per-example TTFT speedups over full prefill (paired, so drift cancels), and
    against ``fidelity_target`` (nats) the fraction of examples whose ``answer_max_kl`` is within
    it (a target promises 0.9 of prompts like its calibration's); ``greedy_differs``: the
    fraction whose greedy answer is not full prefill's, token for token."""
    if not records:
        raise ValueError("no records to summarise")
    out: dict[str, Any] = {"n": len(records)}
    for key in _MEANS:
        values = [float(r[key]) for r in records if key in r]  # journals of older runs lack some
        out[key] = statistics.fmean(values) if values else None
    divergences = [float(r["answer_max_kl"]) for r in records if "answer_max_kl" in r]
    out["fidelity_target"] = fidelity_target
    out["within_target"] = out["answer_max_kl_p90"] = None
    if divergences:
        out["within_target"] = statistics.fmean(d <= fidelity_target for d in divergences)
        out["answer_max_kl_p90"] = metrics.summarize(divergences)["p90"]
    match = out["continuation_match"]
    out["greedy_differs"] = None if match is None else 1.0 - match
    ttft = metrics.summarize(r["ttft_s"] for r in records)
    out["ttft_median_s"], out["ttft_p90_s"], out["ttft_mean_s"] = (
        ttft["median"],
        ttft["p90"],
        ttft["mean"],
    )
    out["ttft_speedup_paired_median"] = statistics.median(r["ttft_speedup"] for r in records)
    return out


def _add_speedups(summary: dict[str, dict[str, Any]]) -> None:
    full = summary["full"]["ttft_median_s"]
    for s in summary.values():
        s["ttft_speedup"] = full / s["ttft_median_s"]


def _config_dict(config: EvalConfig, llm, methods: list[Method], n: int) -> dict[str, Any]:
    info, blend = llm.engine.info, BlendConfig()
    d = asdict(config)
    d.update(
        methods=[m.name for m in methods],
        num_examples=n,
        model_name=info.model_name,
        architecture=info.architecture,
        dtype=info.dtype,  # resolved ("auto" -> what ran)
        reference="full",
        decoding="greedy",
        selection=blend.selection,
        check_layer=blend.check_layer,
        correction=blend.correction,
        correction_shrink=blend.correction_shrink,
    )
    return d
