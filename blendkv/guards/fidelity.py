"""How close a blended answer is to full prefill's: the runs and the logit comparison.

``ask --compare-full`` (:mod:`blendkv.rag.explain`) and the evaluation harness
(``blendkv.eval``, which imports these from here) share them:

- :func:`generate_cold`: one request on an empty prefix cache, so its TTFT is its own path's.
- :func:`teacher_forced_logits`: next-token logits along a given answer, full prefill or blend.
- :func:`kl_divergence`, :func:`first_token_agreement`, :func:`teacher_forced_fidelity`: the
  comparison of two such logit tensors (KL in nats, greedy agreement).
- :func:`answer_divergence`: the largest next-token KL along the answer, what a fidelity target
  bounds (the calibration's measure, :mod:`blendkv.guards.calibration`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from blendkv.guards.measure import ANSWER_TOKENS
from blendkv.sampling_params import SamplingParams

__all__ = [
    "ANSWER_TOKENS",
    "Fidelity",
    "TeacherForced",
    "answer_divergence",
    "first_token_agreement",
    "generate_cold",
    "kl_divergence",
    "teacher_forced_fidelity",
    "teacher_forced_logits",
]


def generate_cold(llm, prompt, params: SamplingParams, **kwargs):
    """One request on an empty prefix cache; returns its RequestOutput."""
    llm.engine.block_manager.reset_prefix_cache()
    return llm.generate([prompt], params, **kwargs)[0]


class TeacherForced(NamedTuple):
    rows: torch.Tensor  # [len(answer) + 1, V] float32 next-token logits
    num_cached_tokens: int  # prompt tokens the request took from the prefix cache


def teacher_forced_logits(
    llm,
    token_ids: list[int],
    answer: list[int],
    blended: dict[str, Any] | None = None,
    blend=None,
) -> TeacherForced:
    """Next-token logits along ``answer``: row ``t`` is the distribution after the prompt
    (``token_ids``, its exact ids) plus ``answer[:t]``; full prefill, or with ``blend`` (a
    BlendConfig) the blended prompt dict ``blended`` fused as ``blend`` says.

    Call it right after a run of the same prompt and mode: the request then hits that run's
    prompt blocks in the prefix cache (full prefill: the exact K/V; blend: the fused K/V, whose
    cache salt is the chunk set and blend config) and computes only the rest. A blended request
    whose hit stops inside the chunks would re-blend the rest on its own, so it is rerun cold.
    """
    start = len(token_ids) - 1
    params = SamplingParams(max_tokens=1)
    if blend is not None:
        assert blended is not None, "a blended run needs the blended prompt dict"
        prompt = {**blended, "continuation": list(answer)}
        kwargs = dict(blend=blend, logits_from=start)
        out = llm.generate([prompt], params, **kwargs)[0]
        if out.blend_stats.tokens_reused:  # fused again: not the run's own K/V
            out = generate_cold(llm, prompt, params, **kwargs)
    else:
        out = llm.generate([list(token_ids) + list(answer)], params, logits_from=start)[0]
    rows = out.extra["prompt_logits"]
    assert rows.shape[0] == len(answer) + 1, (tuple(rows.shape), len(answer))
    return TeacherForced(rows, int(out.metrics.num_cached_tokens))


def kl_divergence(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P_test) per row, in nats, as float64, from logits of shape ``[..., V]``.

    Computed from ``log_softmax`` in float64 (no softmax-then-log underflow). Vocabulary entries
    where ``P_ref`` is 0 (logit ``-inf``) contribute 0. Returns shape ``[...]``; rounding below
    zero is clamped to 0 so identical logits give exactly 0.
    """
    if ref_logits.shape != test_logits.shape:
        raise ValueError(
            f"logit shapes differ: ref {tuple(ref_logits.shape)} vs test {tuple(test_logits.shape)}"
        )
    if ref_logits.dim() == 0:
        raise ValueError("logits need a vocabulary dimension")
    log_p = torch.log_softmax(ref_logits.detach().to(torch.float64), dim=-1)
    log_q = torch.log_softmax(test_logits.detach().to(torch.float64), dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(dim=-1).clamp_min(0.0)


def first_token_agreement(ref_logits_row: torch.Tensor, test_logits_row: torch.Tensor) -> bool:
    """Whether both ``[V]`` logit rows pick the same greedy token (ties: lowest id wins)."""
    if ref_logits_row.dim() != 1 or ref_logits_row.shape != test_logits_row.shape:
        raise ValueError(
            "expected two [V] rows of equal size, got "
            f"{tuple(ref_logits_row.shape)} and {tuple(test_logits_row.shape)}"
        )
    return bool(torch.argmax(ref_logits_row) == torch.argmax(test_logits_row))


class Fidelity(NamedTuple):
    mean_kl: float  # mean over scored positions of KL(P_full || P_method), nats
    top1_agreement: float  # fraction of scored positions with equal argmax, in [0, 1]


def teacher_forced_fidelity(
    ref_logits: torch.Tensor, test_logits: torch.Tensor, max_tokens: int = 16
) -> Fidelity:
    """Fidelity along full prefill's answer, both ``[T, V]`` and teacher-forced on it.

    Row ``t`` is the next-token distribution after the prompt plus the first ``t`` tokens of
    full prefill's greedy answer. Only the first ``min(T, max_tokens)`` rows are scored (answers
    open with a fixed phrase, so the first row alone says little; later rows trail off).
    """
    if ref_logits.dim() != 2 or ref_logits.shape != test_logits.shape:
        raise ValueError(
            "expected two [T, V] logit tensors of equal shape, got "
            f"{tuple(ref_logits.shape)} and {tuple(test_logits.shape)}"
        )
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    num_tokens = min(ref_logits.shape[0], max_tokens)
    if num_tokens == 0:
        raise ValueError("no positions to score (T == 0)")
    ref, test = ref_logits[:num_tokens], test_logits[:num_tokens]
    mean_kl = kl_divergence(ref, test).mean().item()
    agree = (ref.argmax(dim=-1) == test.argmax(dim=-1)).to(torch.float64).mean().item()
    return Fidelity(mean_kl, agree)


def answer_divergence(
    ref_logits: torch.Tensor, test_logits: torch.Tensor, max_tokens: int = ANSWER_TOKENS
) -> float:
    """The largest next-token KL(ref || test) over the first ``max_tokens`` rows, in nats: what
    ``BlendConfig(fidelity_target=...)`` bounds, both ``[T, V]`` and teacher-forced along full
    prefill's answer (row ``t``: after the prompt plus its first ``t`` tokens). A single token
    where the two distributions part shows here; a mean hides it."""
    if ref_logits.dim() != 2 or ref_logits.shape != test_logits.shape:
        raise ValueError(
            "expected two [T, V] logit tensors of equal shape, got "
            f"{tuple(ref_logits.shape)} and {tuple(test_logits.shape)}"
        )
    if max_tokens < 1 or ref_logits.shape[0] == 0:
        raise ValueError(f"no positions to score (T = {ref_logits.shape[0]}, max {max_tokens})")
    return float(kl_divergence(ref_logits[:max_tokens], test_logits[:max_tokens]).max())
