"""The blend part of ``blendkv bench gpu``: TTFT of full prefill, blend and reuse at the prompt
sizes users have (``--blend-prompts TOKENS:DOCS,...``; default 3,000 tokens of 10 documents,
6,144 of 10 and 16,384 of 24), each with a warm chunk store.

Per size, interleaved, median of ``--repeats``: full prefill of the same tokens; the default
selection at ratio 0.1 (:data:`PROPHET`: a fidelity target means nothing on random weights);
blend@``--ratio`` (CacheBlend's one-pass V-deviation pick, its published
setting); reuse (nothing recomputed); the engine's own choice (no config passed: the cost check
picks blend, the cheaper selection or full prefill, and says which). Then one more run of
full, default blend and reuse under ``torch.profiler``: host busy time, device kernel time,
kernel launches and host syncs per request. Other engine settings (layers loaded first, the
device tier, the prefill kernel's key splits and tiles, eager steps) are compared by engines of
their own (:mod:`blendkv.eval.bench.gpu_variants`).
"""

from __future__ import annotations

import statistics
from collections import Counter

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.eval.random_model import random_text

# The blend timed: ProphetKV with the K correction at ratio 0.1. The default config's fidelity
# target picks its ratio from a calibration, which random weights cannot give.
PROPHET = BlendConfig(recompute_ratio=0.1)


def parse_prompts(text: str) -> list[tuple[int, int]]:
    """``"6144:10,16384:24"`` -> [(6144, 10), (16384, 24)] (tokens, documents)."""
    sizes = []
    for part in text.split(","):
        tokens, _, docs = part.strip().partition(":")
        sizes.append((int(tokens), int(docs or 10)))
    if any(t < 16 or d < 1 for t, d in sizes):
        raise ValueError(f"--blend-prompts wants TOKENS:DOCS pairs, got {text!r}")
    return sizes


def blend_prompt(manager, tokens: int, docs: int, seed: int) -> dict:
    """A prompt of ``docs`` random documents of about ``tokens`` tokens in all."""

    def build(words: int) -> dict:
        return {
            "documents": [random_text(words, seed=seed + d) for d in range(docs)],
            "query": "Which city is the capital of France?",
        }

    words = max(8, tokens // docs)
    n = len(manager.prepare(build(words), BlendConfig()).prompt.token_ids)
    return build(max(8, round(words * tokens / n)))


def bench_blend_size(llm, tokens: int, docs: int, args, seed: int):
    """One prompt size: (its row: TTFTs, median of ``args.repeats``, the engine's choice,
    profiles; the full / blend / reuse requests as callables, for ``--profile``; the prompt)."""
    from blendkv.eval.bench.profile_gpu import profile_once

    manager = llm.blend_manager()
    prompt = blend_prompt(manager, tokens, docs, seed)
    state = manager.prepare(prompt, BlendConfig())
    llm.precompute_chunks(state.prompt.chunks)
    full_ids = state.prompt.token_ids
    assert llm.engine.kv_connector.cost_check, (
        "the engine's choice is measured: blend_cost_check=True"
    )
    runs = _runs(llm, prompt, full_ids, args)
    for run in runs.values():  # warm: kernels, checksums, memory tier, the cost check's rates
        run()
    times, last, choices = _time_runs(runs, args.repeats)
    row: dict = {"tokens": len(full_ids), "docs": docs, "engine_choices": dict(choices)}
    _add_times(row, times, last, args.ratio)
    for name in ("full", "blend", "reuse"):
        row[f"profile_{name}"] = profile_once(runs[name])
    return row, {name: runs[name] for name in ("blend", "reuse", "full")}, prompt


def _runs(llm, prompt: dict, full_ids: list[int], args) -> dict:
    """The requests timed at one size, by name: each a callable returning (TTFT, output)."""
    one = SamplingParams(temperature=0.0, max_tokens=1)
    default, ratio = PROPHET, BlendConfig(selection="v_deviation", recompute_ratio=args.ratio)
    reuse = BlendConfig(recompute_ratio=0.0)

    def ttft(blend=None, ids=None):
        out = llm.generate([ids or prompt], one, blend=blend)[0]
        return out.metrics.ttft, out

    return {
        "full": lambda: ttft(ids=full_ids),
        "blend": lambda: ttft(default),
        f"blend_v{args.ratio}": lambda: ttft(ratio),
        "reuse": lambda: ttft(reuse),
        "engine_choice": lambda: ttft(),
    }


def add_variant(row: dict, variant_row: dict) -> None:
    """A variant's figures (:func:`~blendkv.eval.bench.gpu_variants.time_variant`) into a
    size's ``row``, with the device tier's speedup over full prefill."""
    row.update(variant_row)
    if "blend_device_s" in row:
        row["blend_device_speedup"] = row["full_s"] / row["blend_device_s"]


def _time_runs(runs: dict, repeats: int):
    """Every run ``repeats`` times, interleaved: (seconds by name, the last output by name,
    what the cost check ran over the repeats)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    last = {}
    choices: Counter[str] = Counter()  # what the cost check ran, over the timed repeats
    for _ in range(repeats):
        for name, run in runs.items():
            seconds, last[name] = run()
            times[name].append(seconds)
        choices[last["engine_choice"].blend_stats.cost_choice or "as configured"] += 1
    return times, last, choices


def _add_times(row: dict, times: dict, last: dict, ratio: float) -> None:
    """Into ``row``: the median seconds and speedups, the engine's choice, the tier and the
    blend's load and write stats."""
    for name, values in times.items():
        row[f"{name}_s"] = statistics.median(values)
    for name in ("blend", f"blend_v{ratio}", "reuse", "engine_choice"):
        row[f"{name}_speedup"] = row["full_s"] / row[f"{name}_s"]
    row["blend_vs_reuse"] = row["blend_s"] / row["reuse_s"]
    stats = last["engine_choice"].blend_stats
    row["engine_choice"] = stats.cost_choice or "as configured"
    row["engine_choice_reason"] = stats.cost_reason
    blend_stats = last["blend"].blend_stats
    row["kv_bytes"] = blend_stats.kv_bytes_loaded
    row["write_s"] = blend_stats.write_seconds
    row["write_hidden_s"] = blend_stats.load_hidden_seconds


def print_size(row: dict, ratio: float) -> None:
    ms = lambda key: f"{row[key] * 1e3:.1f} ms"  # noqa: E731
    print(
        f"  {row['tokens']} tokens, {row['docs']} docs: full {ms('full_s')}, "
        f"blend {ms('blend_s')} ({row['blend_speedup']:.2f}x), blend_v{ratio} "
        f"{ms(f'blend_v{ratio}_s')} ({row[f'blend_v{ratio}_speedup']:.2f}x), reuse "
        f"{ms('reuse_s')} ({row['reuse_speedup']:.2f}x); blend / reuse "
        f"{row['blend_vs_reuse']:.2f}; engine's "
        f"choice {row['engine_choice']} {ms('engine_choice_s')} (over the repeats: "
        + ", ".join(f"{k} x{v}" for k, v in row["engine_choices"].items())
        + ")"
    )
    if "serial_load_s" in row:
        print(f"    every layer loaded before the forward: blend {ms('serial_load_s')}")
    if "blend_unsplit_s" in row:
        print(
            f"    without key splits: blend {ms('blend_unsplit_s')}, reuse {ms('reuse_unsplit_s')}"
        )
    if "blend_untuned_s" in row:
        print(
            f"    prefill kernel's default tiles: blend {ms('blend_untuned_s')}, reuse "
            f"{ms('reuse_untuned_s')}"
        )
    if "blend_eager_s" in row:
        print(
            f"    without piecewise graphs: full {ms('full_eager_s')}, blend "
            f"{ms('blend_eager_s')}, reuse {ms('reuse_eager_s')}"
        )
    if "blend_device_s" in row:
        print(
            f"    chunks kept in device memory: blend {ms('blend_device_s')} "
            f"({row['blend_device_speedup']:.2f}x), reuse {ms('reuse_device_s')}; chunks "
            f"read from there {row['device_tier_chunks']}"
        )
    for name in ("full", "blend", "reuse", "blend_eager"):
        p = row.get(f"profile_{name}")
        if p:
            print(
                f"    {name:5s} under the profiler: wall {p['wall_ms']} ms, host busy "
                f"{p['host_busy_ms']} ms, kernels {p['device_kernel_ms']} ms, launches "
                f"{p['kernel_launches']}, syncs {p['host_syncs']}"
            )
