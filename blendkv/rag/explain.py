"""Why did ``ask`` answer that? The assembled prompt with its pieces marked, and full prefill
run beside the blend on exactly the same prompt tokens.

The prompt is shown piece by piece, as :class:`~blendkv.connector.prompt.PromptBuilder` assembled
it (each piece is tokenised on its own, so decoding a piece gives exactly its text)::

    | template | instruction | chunk 1 | ... | chunk k | query | template suffix |
     [0, a)      [a, b)       [b, ...)         [query_start, s)   [s, num_tokens)

The comparison runs as ``blendkv eval`` scores a method (:mod:`blendkv.guards.fidelity`, which
the evaluation harness shares): full prefill and the blend each run from an empty prefix cache,
each followed by a teacher-forced request along full prefill's greedy answer; the answer KL is
the mean KL(full || blend) of the next-token distributions along its first ``answer_tokens``
tokens, in nats. The TTFTs are warm: each side runs once untimed (the first run of a shape in
a process pays one-time costs that are not its path's), then the median of a few runs counts.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from blendkv.guards.fidelity import generate_cold, teacher_forced_fidelity, teacher_forced_logits
from blendkv.sampling_params import SamplingParams

DEFAULT_ANSWER_TOKENS = 16
TIMED_RUNS = 3  # first-token runs per side whose median TTFT is reported


@dataclass(frozen=True)
class PromptSegment:
    """One piece of an assembled prompt: token positions ``[start, end)`` and their text."""

    kind: str  # "template", "instruction", "chunk", "query", "template_suffix"
    start: int
    end: int
    text: str
    chunk_id: int | None = None  # chunk segments: the stored chunk and its document
    doc_id: str | None = None
    source: str | None = None  # the document's source (path or title), if it has one

    @property
    def label(self) -> str:
        """How the chunk's document is named to a reader: its source, else its doc id."""
        return self.source or self.doc_id or "?"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prompt_segments(rag, prompt: dict, sources) -> list[PromptSegment]:
    """The pieces of ``prompt`` (a :meth:`RAGPipeline.blended_prompt`) built from ``sources``
    (its retrieved chunks, in prompt order), covering every token once, in order."""
    manager = rag.manager
    built = manager.prepare(prompt, None).prompt
    template, suffix = manager.builder.template_pieces(prompt.get("system"))
    ids = built.token_ids
    suffix_start = len(ids) - len(suffix)
    assert ids[: len(template)] == template and ids[suffix_start:] == suffix
    assert len(built.chunks) == len(sources) and built.query_start <= suffix_start

    def segment(kind, start, end, **chunk) -> PromptSegment:
        text = rag.llm.tokenizer.decode(ids[start:end], skip_special_tokens=False)
        return PromptSegment(kind, start, end, text, **chunk)

    out = [segment("template", 0, len(template))]
    if built.prefix_len > len(template):
        out.append(segment("instruction", len(template), built.prefix_len))
    for (start, end), src in zip(built.chunk_spans, sources, strict=True):
        out.append(
            segment(
                "chunk", start, end, chunk_id=src.chunk_id, doc_id=src.doc_id, source=src.source
            )
        )
    out.append(segment("query", built.query_start, suffix_start))
    if suffix:
        out.append(segment("template_suffix", suffix_start, len(ids)))
    return [s for s in out if s.end > s.start]


def format_prompt(segments: list[PromptSegment]) -> str:
    """The prompt as the model saw it, each piece under a marker line naming its positions."""
    num_chunks = sum(s.kind == "chunk" for s in segments)
    lines = [f"prompt ({segments[-1].end} tokens), as the model saw it:"]
    chunk = 0
    for s in segments:
        label = s.kind.replace("_", " ")
        if s.kind == "chunk":
            chunk += 1
            label = f"chunk {chunk}/{num_chunks}: stored chunk {s.chunk_id} of {s.label}"
        lines.append(f"=== {label}  [tokens {s.start}-{s.end}) ===")
        lines.append(s.text)
    lines.append("=== end of prompt ===")
    return "\n".join(lines)


@dataclass(frozen=True)
class FullComparison:
    """Full prefill and the blend on the same prompt tokens, both greedy."""

    num_prompt_tokens: int
    full_answer: str
    full_ttft: float  # seconds, median of warm runs from an empty prefix cache
    blend_answer: str
    blend_ttft: float  # seconds, as full_ttft (chunks warm in the store)
    recompute_ratio: float | str  # what the blend ran at (a target's: the engine's pick)
    answer_kl: float  # mean KL(full || blend) along full's answer, nats
    answer_agreement: float  # share of those positions where both argmaxes agree
    scored_tokens: int  # positions scored: min(len(full's answer), answer_tokens)
    fidelity_target: float | None = None  # nats, when the blend had a target

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "full": {"answer": self.full_answer, "ttft_s": self.full_ttft},
            "blend": {
                "answer": self.blend_answer,
                "ttft_s": self.blend_ttft,
                "recompute_ratio": self.recompute_ratio,
                "fidelity_target": self.fidelity_target,
            },
            "answer_kl": self.answer_kl,
            "answer_agreement": self.answer_agreement,
            "scored_tokens": self.scored_tokens,
        }

    def format(self) -> str:
        agree = round(self.answer_agreement * self.scored_tokens)
        blend = f"blend@{_ratio(self.recompute_ratio)}"
        if self.fidelity_target is not None:
            blend += f" (target {self.fidelity_target:g} nats)"
        w = max(14, len(blend))
        return "\n".join(
            [
                f"full prefill beside the blend (same {self.num_prompt_tokens} prompt tokens, "
                f"both greedy; TTFT: median of {TIMED_RUNS} warm runs):",
                f"  {'full prefill':{w}s} TTFT {self.full_ttft * 1e3:7.0f} ms  "
                f"{' '.join(self.full_answer.split())}",
                f"  {blend:{w}s} TTFT {self.blend_ttft * 1e3:7.0f} ms  "
                f"{' '.join(self.blend_answer.split())}",
                f"  answer KL {self.answer_kl:.4f} nats (teacher-forced along full prefill's "
                f"first {self.scored_tokens} answer tokens); top-1 agreement "
                f"{agree}/{self.scored_tokens}",
            ]
        )


def compare_full(
    rag, prompt: dict, blend, max_tokens: int, answer_tokens: int = DEFAULT_ANSWER_TOKENS
) -> FullComparison:
    """Run full prefill and the blend (``blend``: a BlendConfig) on ``prompt`` and compare.

    Both runs are greedy with ``max_tokens``; each side's TTFT is :func:`warm_ttft`'s. With
    the engine's prefix cache on, each teacher-forced request reuses its run's own prompt K/V;
    without it, it recomputes them (slower, same numbers).
    """
    llm = rag.llm
    ids = list(rag.manager.prepare(prompt, blend).prompt.token_ids)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    # Full first: the blend is scored along full prefill's answer (as in blendkv eval).
    full_ttft = warm_ttft(llm, ids)
    full_run = generate_cold(llm, ids, params)
    answer = list(full_run.outputs[0].token_ids)[:answer_tokens]
    ref = teacher_forced_logits(llm, ids, answer).rows  # right after its run: see its docstring
    blend_ttft = warm_ttft(llm, prompt, blend=blend)
    blend_run = generate_cold(llm, prompt, params, blend=blend)
    test = teacher_forced_logits(llm, ids, answer, prompt, blend).rows
    k = len(answer)
    fidelity = teacher_forced_fidelity(ref[:k], test[:k], answer_tokens)
    stats = blend_run.blend_stats
    ran = stats.config if stats is not None and stats.config is not None else blend
    return FullComparison(
        num_prompt_tokens=len(ids),
        full_answer=full_run.text.strip(),
        full_ttft=full_ttft,
        blend_answer=blend_run.text.strip(),
        blend_ttft=blend_ttft,
        recompute_ratio=ran.recompute_ratio,
        answer_kl=fidelity.mean_kl,
        answer_agreement=fidelity.top1_agreement,
        scored_tokens=min(k, answer_tokens),
        fidelity_target=blend.fidelity_target,
    )


def warm_ttft(llm, prompt, runs: int = TIMED_RUNS, **kwargs) -> float:
    """Median TTFT (seconds) of ``runs`` first-token requests from an empty prefix cache,
    after one untimed: warm timings, as every request after a process's first sees them."""
    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    generate_cold(llm, prompt, first_token, **kwargs)
    ttfts = [generate_cold(llm, prompt, first_token, **kwargs).metrics.ttft for _ in range(runs)]
    return float(statistics.median(ttfts))


def _ratio(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:g}"
