"""``ask --compare-full`` reports warm TTFTs: each side's first run in the process is not
timed, and the median of the timed runs is reported."""

from __future__ import annotations

import statistics

from blendkv.blend.config import BlendConfig
from blendkv.rag.explain import TIMED_RUNS, compare_full, warm_ttft

DOCS = [
    "Guido van Rossum created Python. It was first released in 1991. " * 3,
    "Jupiter is the largest planet in the Solar System. Saturn has rings. " * 3,
]


def test_compare_full_reports_the_median_of_warm_runs(tiny_rag, monkeypatch):
    tiny_rag.ingest(DOCS, progress=False)
    sources = tiny_rag.retrieve("Who created Python?", 2)
    prompt = tiny_rag.blended_prompt("Who created Python?", sources)
    runs: list[tuple[bool, int, float]] = []  # (blended, max_tokens, ttft) of every request
    generate = tiny_rag.llm.generate

    def recording(prompts, params, **kwargs):
        outs = generate(prompts, params, **kwargs)
        for p, out in zip(prompts, outs, strict=True):
            runs.append((isinstance(p, dict), params.max_tokens, out.metrics.ttft))
        return outs

    monkeypatch.setattr(tiny_rag.llm, "generate", recording)
    cmp = compare_full(tiny_rag, prompt, BlendConfig(), max_tokens=4)
    for blended, reported in ((False, cmp.full_ttft), (True, cmp.blend_ttft)):
        first_token = [ttft for b, n, ttft in runs if b == blended and n == 1]
        assert len(first_token) >= TIMED_RUNS + 1
        timed = first_token[1 : TIMED_RUNS + 1]  # the first run is the untimed warm-up
        assert reported == statistics.median(timed)
        assert any(b == blended and n == 4 for b, n, _ in runs)  # the answer run


def test_warm_ttft_runs_once_untimed_then_takes_the_median(tiny_rag, monkeypatch):
    ttfts: list[float] = []
    generate = tiny_rag.llm.generate

    def recording(prompts, params, **kwargs):
        outs = generate(prompts, params, **kwargs)
        ttfts.extend(out.metrics.ttft for out in outs)
        return outs

    monkeypatch.setattr(tiny_rag.llm, "generate", recording)
    value = warm_ttft(tiny_rag.llm, [5, 6, 7, 8, 9], runs=5)
    assert len(ttfts) == 6 and value == statistics.median(ttfts[1:])
