"""Evaluation methods: parsing their names and running one method on one example.

A method is how the prompt's K/V comes about:

- ``full``: plain prefill of the blended prompt's token ids (the quality and TTFT reference).
- ``prefix``: the engine's prefix cache, warmed by the same documents in reversed order just
  before (what a vLLM user gets when passages are retrieved in another order).
- ``reuse``: every chunk's stored K/V as is (``BlendConfig(recompute_ratio=0.0)``).
- ``blend@R``: CacheBlend with recompute ratio ``R`` in [0, 1]; ``blend@R:STRATEGY`` names
  another fusion strategy of :class:`BlendConfig`: a selection (``attention``, ``k_deviation``,
  ``random``, ``prophet``, ``heads``; the default is ``v_deviation``) followed by options
  joined with ``+`` (:func:`parse_strategy`), e.g. ``blend@0.1:prophet+cv+h4``.
- ``default``: ``BlendConfig()`` as shipped, whatever its defaults are (today ProphetKV with
  the K correction at ratio 0.10, so it is the same method as ``blend@0.1``). It is passed as
  the request's own config, so the engine's cost check, which may run full prefill or a cheaper
  selection for a request that passes none, does not change it.
- ``target@T``: ``BlendConfig(fidelity_target=T)``, T in nats (>= 0): the engine picks the
  ratio per request from a calibration beside the run's chunk store (``--calibrate N`` makes
  one first; without it the conservative 0.3); each record's ``recompute_ratio`` says which.
- ``hf``: transformers ``generate`` on the same token ids (an engine-independent reference).

Every timed request starts from an empty prefix cache (except the ``prefix`` warm-up), so TTFT
measures the method's own path. The teacher-forced request that follows a method's run reuses
that run's prompt K/V through the prefix cache (the same K/V, not recomputed), so it computes
only the answer tokens and the prompt's last partial block.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from blendkv import SamplingParams
from blendkv.blend.config import SELECTIONS, BlendConfig
from blendkv.errors import BlendKVError, ConfigError
from blendkv.guards.fidelity import TeacherForced, generate_cold, teacher_forced_logits

__all__ = ["Method", "MethodError", "MethodRun", "parse_method", "parse_methods", "run_method"]

PLAIN_METHODS = ("full", "prefix", "reuse", "default", "hf")


class MethodError(BlendKVError, ValueError):
    """A method name on the command line is not one ``blendkv eval`` knows."""


@dataclass(frozen=True)
class Method:
    name: str  # as written on the command line (``blend@0.15``), the key in every output
    kind: str  # "full" | "prefix" | "blend" | "hf"
    blend: BlendConfig | None = None  # for kind == "blend" (``reuse`` is blend at 0.0)

    @property
    def fidelity_target(self) -> float | None:
        """The method's own fidelity target (nats): ``target@T``'s T, else None."""
        if self.blend is None or not self.blend.target_mode:
            return None
        return self.blend.fidelity_target


_OPTIONS = (
    "ck|cv|ckv|c0 (correction of K, V, both, none), sN (correction_shrink N), "
    "pp|p0 (correction_prior pooled, zero), hN (chunk_head_tokens N), eN (chunk_samples N), "
    "rsN (reselect N), x0 (skip_exact off)"
)


def parse_strategy(text: str) -> dict[str, Any]:
    """``SELECTION[+OPTION...]`` -> :class:`BlendConfig` keyword arguments. Options: ``ck``,
    ``cv``, ``ckv``, ``c0`` (``correction`` of K, V, both or none: ``v_deviation+c0`` is
    CacheBlend as published), ``sN`` (``correction_shrink=N``), ``pp``
    / ``p0`` (``correction_prior`` ``pooled`` / ``zero``: each chunk's shift shrunk towards
    the mean shift of all recomputed rows / towards 0), ``hN``
    (``chunk_head_tokens=N``), ``eN`` (``chunk_samples=N``), ``rsN`` (``reselect=N``),
    ``x0`` (``skip_exact=False``: exact rows may be picked too)."""
    selection, *options = text.split("+")
    if selection not in SELECTIONS:
        raise MethodError(f"unknown selection {selection!r}; use one of {', '.join(SELECTIONS)}")
    kwargs: dict[str, Any] = {"selection": selection}
    for opt in options:
        try:
            if opt in ("ck", "cv", "ckv"):
                kwargs["correction"] = opt[1:]
            elif opt == "c0":
                kwargs["correction"] = "none"
            elif opt == "x0":
                kwargs["skip_exact"] = False
            elif opt in ("pp", "p0"):
                kwargs["correction_prior"] = "pooled" if opt == "pp" else "zero"
            elif opt.startswith("rs"):
                kwargs["reselect"] = int(opt[2:])
            elif opt.startswith("s"):
                kwargs["correction_shrink"] = float(opt[1:])
            elif opt.startswith("e"):
                kwargs["chunk_samples"] = int(opt[1:])
            elif opt.startswith("h"):
                kwargs["chunk_head_tokens"] = int(opt[1:])
            else:
                raise ValueError
        except ValueError:
            raise MethodError(f"unknown strategy option {opt!r}; options: {_OPTIONS}") from None
    return kwargs


def parse_method(name: str) -> Method:
    """``"full"``, ``"prefix"``, ``"reuse"``, ``"default"``, ``"hf"``, ``"target@T"`` with T
    >= 0 nats, ``"blend@R"`` with R in [0, 1], or
    ``"blend@R:STRATEGY"`` with STRATEGY a selection of
    :data:`~blendkv.blend.config.SELECTIONS` and options (:func:`parse_strategy`). A record
    name ``METHOD[codec]`` (``eval --kv-codec``, :mod:`blendkv.eval.codecs`) is METHOD."""
    name = name.strip()
    base, bracket, codec = name.partition("[")
    if bracket and codec.endswith("]") and base:
        from dataclasses import replace

        return replace(parse_method(base), name=name)
    if name in ("full", "prefix", "hf"):
        return Method(name, name)
    if name == "reuse":
        return Method(name, "blend", BlendConfig(recompute_ratio=0.0))
    if name == "default":
        return Method(name, "blend", BlendConfig())
    if name.startswith("target@"):
        return Method(name, "blend", BlendConfig(fidelity_target=_target(name)))
    if name.startswith("blend@"):
        text, colon, selection = name.removeprefix("blend@").partition(":")
        try:
            ratio = float(text)
        except ValueError:
            raise MethodError(
                f"bad method {name!r}: the recompute ratio after 'blend@' must be a number "
                "in [0, 1], e.g. blend@0.15"
            ) from None
        if not 0.0 <= ratio <= 1.0:
            raise MethodError(f"bad method {name!r}: recompute ratio {ratio} is not in [0, 1]")
        kwargs = {}
        if colon:
            try:
                kwargs = parse_strategy(selection)
                config = BlendConfig(recompute_ratio=ratio, **kwargs)
            except (MethodError, ConfigError) as e:
                raise MethodError(
                    f"bad method {name!r}: {e} (e.g. blend@0.15:attention, blend@0.1:prophet+cv)"
                ) from None
        else:
            config = BlendConfig(recompute_ratio=ratio)
        return Method(name, "blend", config)
    raise MethodError(
        f"unknown method {name!r}; use one of {', '.join(PLAIN_METHODS)}, blend@R "
        "(R in [0, 1], e.g. blend@0.15), blend@R:SELECTION (e.g. blend@0.15:attention) or "
        "target@T (a fidelity target of T >= 0 nats, e.g. target@0.5)"
    )


def _target(name: str) -> float:
    """``target@T``'s T, a finite number of nats >= 0."""
    try:
        target = float(name.removeprefix("target@"))
    except ValueError:
        target = math.nan
    if not 0.0 <= target < math.inf:
        raise MethodError(
            f"bad method {name!r}: the fidelity target after 'target@' must be a finite "
            "number of nats >= 0, e.g. target@0.5"
        )
    return target


def _identity(method: Method) -> tuple:
    """Methods with equal identities compute the same K/V: the selection strategy does not
    matter when no reused token (R=0) or every one (R=1) is recomputed."""
    if method.blend is None:
        return (method.kind,)
    b = method.blend
    if b.target_mode:  # the ratio is the engine's pick: the target names the method
        return (method.kind, "target", b.fidelity_target)
    strategy = b.cache_key() if 0.0 < b.recompute_ratio < 1.0 else None
    return (method.kind, b.recompute_ratio, strategy)


def parse_methods(spec: str) -> list[Method]:
    """A comma-separated list of method names; duplicates (also ``reuse`` and ``blend@0``,
    ``blend@1`` and ``blend@1.0:random``, or ``blend@0.15`` and ``blend@0.15:v_deviation``) and
    empty lists are errors."""
    names = [n for n in (s.strip() for s in spec.split(",")) if n]
    if not names:
        raise MethodError("no methods given; e.g. --methods full,reuse,blend@0.15")
    methods = [parse_method(n) for n in names]
    seen: dict[tuple, str] = {}
    for m in methods:
        key = _identity(m)
        if key in seen:
            raise MethodError(f"methods {seen[key]!r} and {m.name!r} are the same method")
        seen[key] = m.name
    return methods


class MethodRun(NamedTuple):
    """One method's greedy generation on one example (timed)."""

    token_ids: list[int]
    text: str
    ttft: float  # seconds
    num_cached_tokens: int  # prompt tokens served by the engine's prefix cache
    blend_stats: dict[str, Any] | None


@dataclass
class ExamplePrompt:
    """One example's prompt in the forms the methods need."""

    blended: dict[str, Any]  # the blended prompt dict (documents, query, instruction)
    token_ids: list[int]  # its exact ids, i.e. full prefill's prompt
    reversed_token_ids: list[int]  # same documents in reversed order (the ``prefix`` warm-up)


def run_method(llm, hf, method: Method, ex: ExamplePrompt, params) -> MethodRun:
    """Greedy generation of ``method`` on ``ex``; ``hf`` is an :class:`HFRunner` (or None)."""
    if method.kind == "hf":
        return hf.generate(ex.token_ids, params.max_tokens)
    if method.kind == "blend":
        out = generate_cold(llm, ex.blended, params, blend=method.blend)
    elif method.kind == "prefix":
        llm.engine.block_manager.reset_prefix_cache()
        llm.generate([ex.reversed_token_ids], SamplingParams(max_tokens=1))
        out = llm.generate([ex.token_ids], params)[0]  # timed with the warm prefix cache
    else:
        out = generate_cold(llm, ex.token_ids, params)
    stats = out.blend_stats.to_dict() if out.blend_stats is not None else None
    return MethodRun(
        list(out.outputs[0].token_ids),
        out.text,
        float(out.metrics.ttft),
        int(out.metrics.num_cached_tokens),
        stats,
    )


def teacher_forced_rows(
    llm, hf, method: Method, ex: ExamplePrompt, answer: list[int]
) -> TeacherForced:
    """Next-token logits along ``answer``: row ``t`` is the distribution after the prompt plus
    ``answer[:t]``, under ``method``.

    Call it right after :func:`run_method` of the same method on the same example: the request
    then hits that run's prompt blocks in the prefix cache (``full``: the exact K/V; ``blend``:
    the fused K/V, whose cache salt is the chunk set and blend config) and computes only the
    rest. A blended request whose hit stops inside the chunks would re-blend the rest on its
    own, so it is rerun cold instead. ``prefix`` is scored like ``full``: its warm blocks hold
    the exact K/V of the same tokens at the same positions.
    """
    if method.kind == "hf":
        return TeacherForced(hf.prompt_logits(ex.token_ids + answer, len(ex.token_ids) - 1), 0)
    if method.kind == "blend":
        return teacher_forced_logits(llm, ex.token_ids, answer, ex.blended, method.blend)
    return teacher_forced_logits(llm, ex.token_ids, answer)  # full and prefix


class HFRunner:
    """transformers on the engine's own checkpoint, for the ``hf`` method."""

    def __init__(
        self,
        model_dir,
        dtype: str,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        device: str = "cpu",
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = (
            AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
            .to(device)
            .eval()
        )
        self.tokenizer = tokenizer
        self.eos = list(eos_token_ids)  # the engine's stop ids, so both stop alike

    @torch.inference_mode()
    def generate(self, token_ids: list[int], max_tokens: int) -> MethodRun:
        from transformers.generation.streamers import BaseStreamer

        times: list[float] = []

        class _Clock(BaseStreamer):
            # generate() calls put() once with the prompt, then once per new token.
            def put(self, value):
                times.append(time.perf_counter())

            def end(self):
                pass

        ids = torch.tensor([token_ids], device=self.device)
        t0 = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=self.eos or None,
            pad_token_id=self.eos[0] if self.eos else 0,
            streamer=_Clock(),
        )
        new = out[0, len(token_ids) :].tolist()
        ttft = times[1] - t0 if len(times) > 1 else time.perf_counter() - t0
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return MethodRun(new, text, ttft, 0, None)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], start: int) -> torch.Tensor:
        ids = torch.tensor([token_ids], device=self.device)
        return self.model(ids).logits[0, start:].float().cpu()
