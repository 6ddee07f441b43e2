"""A check on demand: this request's blend against full prefill of the same prompt tokens.

``LLM.generate(..., verify=True)``, ``RAGPipeline.query(..., verify=True)``, ``blendkv ask
--verify`` and the server's ``blend.verify`` run it after the answer. Both sides answer greedily
(``max_tokens`` of the request); then both are teacher-forced along full prefill's answer, so
the per-token divergence is measured where the answers would part. A :class:`Verification`
lands on the output's ``blend_stats.verification``:

- ``same_answer``: whether the two greedy answers are the same tokens: the check that catches a
  flip, which a mean divergence can hide (one divergent token changes the rest of an answer);
- ``max_kl`` / ``mean_kl``: KL(full || blend) of the next-token distributions along full
  prefill's first ``answer_tokens`` tokens (nats), the largest and the mean;
- ``first_token_kl``, ``top1_agreement`` and full prefill's answer text.

It costs a full prefill, a greedy answer and two teacher-forced passes: use it when an answer
matters, or to spot-check (the audit, :mod:`blendkv.guards.audit`, samples live traffic).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from blendkv.sampling_params import SamplingParams

DEFAULT_ANSWER_TOKENS = 16


@dataclass(frozen=True)
class Verification:
    """A blended answer against full prefill of the same prompt tokens, both greedy.

    Attributes:
        same_answer: the two greedy answers are the same tokens.
        full_answer: full prefill's greedy answer.
        blend_answer: the blend's greedy answer (a greedy run of the request's prompt).
        max_kl: the largest KL(full || blend) of the next-token distributions along full
            prefill's answer, nats.
        mean_kl: the mean of the same.
        first_token_kl: the KL of the first answer token's distribution.
        top1_agreement: the share of the scored positions whose argmaxes agree.
        scored_tokens: answer tokens scored: min(len(full's answer), answer_tokens).
        ran_full_prefill: the request itself ran as full prefill (the start gate or the cost
            check chose it): there was nothing to check.
    """

    same_answer: bool
    full_answer: str
    blend_answer: str
    max_kl: float
    mean_kl: float
    first_token_kl: float
    top1_agreement: float
    scored_tokens: int
    ran_full_prefill: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    def describe(self) -> str:
        """One line a user reads."""
        if self.ran_full_prefill:
            return "verified: this request ran as full prefill"
        verdict = "same answer as full prefill" if self.same_answer else "DIFFERS from full prefill"
        return (
            f"verified: {verdict}; KL(full || blend) max {self.max_kl:.4f}, mean "
            f"{self.mean_kl:.4f} nats over {self.scored_tokens} tokens; top-1 agreement "
            f"{self.top1_agreement:.0%}"
        )


def verify(
    llm,
    prompt: dict,
    output,
    blend=None,
    max_tokens: int = 32,
    answer_tokens: int = DEFAULT_ANSWER_TOKENS,
) -> Verification:
    """Verify ``output`` (the RequestOutput of the blended ``prompt`` with ``blend``: its
    BlendConfig, None for the engine's default) against full prefill of its prompt tokens.
    The blend checked is the one that ran (``blend_stats.config``: a fidelity target's ratio,
    the cost check's cheaper selection), run again with the same greedy sampling."""
    from blendkv.blend.config import BlendConfig  # the blend package loads on use
    from blendkv.guards.fidelity import kl_divergence, teacher_forced_logits

    stats = output.blend_stats
    ids = list(output.prompt_token_ids)
    if stats is None or getattr(stats, "fallback", "") or stats.cost_choice == "full_prefill":
        return Verification(True, output.text, output.text, 0.0, 0.0, 0.0, 1.0, 0, True)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    full = llm.generate([ids], greedy)[0]
    config = stats.config or blend or BlendConfig()
    mine = llm.generate([prompt], greedy, blend=config)[0]
    answer = list(full.outputs[0].token_ids)[:answer_tokens]
    # row t: the distribution of answer token t (after the prompt and answer[:t])
    scored = max(1, len(answer))
    ref = teacher_forced_logits(llm, ids, answer).rows[:scored]
    test = teacher_forced_logits(llm, ids, answer, prompt, config).rows[:scored]
    kl = kl_divergence(ref, test)
    agree = (ref.argmax(dim=-1) == test.argmax(dim=-1)).double().mean().item()
    return Verification(
        same_answer=list(mine.outputs[0].token_ids) == list(full.outputs[0].token_ids),
        full_answer=full.text.strip(),
        blend_answer=mine.text.strip(),
        max_kl=float(kl.max()),
        mean_kl=float(kl.mean()),
        first_token_kl=float(kl[0]),
        top1_agreement=agree,
        scored_tokens=len(kl),
    )
