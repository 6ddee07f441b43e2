"""Writing an evaluation's results: JSON, per-example JSONL, a markdown table and two plots.

    DIR/results.json        {"config": {...}, "methods": {name: aggregates}}
    DIR/per_example.jsonl   one record per (example, method)
    DIR/report.md           one table row per method, TTFT speedup vs full, then paired
                            bootstrap intervals (blendkv.eval.bootstrap) of answer KL and EM
    DIR/quality_vs_ttft.png F1 and answer KL against median TTFT, one point per method
    DIR/recompute_sweep.png answer KL and F1 against R, one line per fusion strategy (only
                            with two or more blend@R of one strategy; reuse is R = 0)
    DIR/pareto.png          answer KL against median TTFT, one line per fusion strategy (its
                            ratios), reuse and full as points (with any blend@R)
    DIR/tradeoff.png        TTFT speedup against the fraction of examples within the fidelity
                            target, one point per method, target@T apart from fixed ratios

Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blendkv.eval import bootstrap
from blendkv.eval.methods import parse_method
from blendkv.eval.reference_cache import reference_notice

__all__ = ["format_intervals", "format_table", "interval_rows", "write_outputs"]

# Metrics given bootstrap intervals: fidelity (ratio to reuse too) and accuracy.
INTERVAL_METRICS = ("answer_kl", "em")

# (results key, column header, format)
_COLUMNS = (
    ("n", "n", "{:d}"),
    ("f1", "F1", "{:.3f}"),
    ("em", "EM", "{:.3f}"),
    ("rouge_l", "Rouge-L", "{:.3f}"),
    ("first_token_agreement", "1st-tok agree", "{:.2f}"),
    ("first_token_kl", "1st-tok KL", "{:.4f}"),
    ("answer_kl", "answer KL", "{:.4f}"),
    ("answer_agreement", "answer agree", "{:.3f}"),
    ("continuation_match", "cont. match", "{:.2f}"),
    ("fidelity_target", "target (nats)", "{:g}"),
    ("within_target", "within target", "{:.2f}"),
    ("greedy_differs", "greedy differs", "{:.2f}"),
    ("ttft_median_s", "TTFT p50 (s)", "{:.3f}"),
    ("ttft_p90_s", "TTFT p90 (s)", "{:.3f}"),
    ("ttft_speedup", "speedup vs full", "{:.2f}x"),
    ("recompute_fraction", "recompute", "{:.3f}"),
    ("compute_fraction", "cost", "{:.3f}"),
    ("kv_bytes_loaded", "K/V loaded (MB)", "mb"),
    ("load_seconds", "load (s)", "{:.3f}"),
)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    if fmt == "mb":
        return f"{value / 1e6:.1f}"
    return fmt.format(value)


def format_table(methods: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one row per method in the given order."""
    header = "| method | " + " | ".join(h for _, h, _ in _COLUMNS) + " |"
    rule = "|---|" + "|".join("---:" for _ in _COLUMNS) + "|"
    rows = [
        f"| {name} | " + " | ".join(_cell(s.get(k), f) for k, _, f in _COLUMNS) + " |"
        for name, s in methods.items()
    ]
    return "\n".join([header, rule, *rows])


def interval_rows(
    records: list[dict[str, Any]], baseline: str | None
) -> dict[str, list[bootstrap.MethodComparison]]:
    """Metric -> one paired-bootstrap row per method, against ``baseline`` (default: the run's
    default blend); ``full`` is left out of answer KL (it is the reference, KL 0)."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    base = baseline or bootstrap.default_baseline(methods)
    out = {}
    for metric in INTERVAL_METRICS:
        rows = [r for r in records if not (metric == "answer_kl" and r["method"] == "full")]
        ref = "reuse" if metric == "answer_kl" else None
        out[metric] = bootstrap.compare_methods(rows, metric, base, ref)
    return out


def _ci(iv: bootstrap.Interval | None, fmt: str) -> str:
    if iv is None:
        return "–"
    return f"{fmt.format(iv.point)} [{fmt.format(iv.low)}, {fmt.format(iv.high)}]"


def format_intervals(rows_by_metric: dict[str, list[bootstrap.MethodComparison]]) -> str:
    """Markdown tables of :func:`interval_rows`. A method is called better or worse than the
    baseline only when the difference's 95 % interval excludes 0."""
    parts = []
    for metric, rows in rows_by_metric.items():
        if not rows:
            continue
        base = next((r.method for r in rows if r.verdict == "baseline"), None)
        ratio = metric == "answer_kl"
        header = f"| method | n | {metric} |" + (" ratio to reuse [95% CI] |" if ratio else "")
        header += f" diff to {base or '–'} [95% CI] | wins/losses/ties | vs baseline |"
        lines = [header, "|---|---:|---:|" + ("---:|" if ratio else "") + "---:|---:|---|"]
        for r in rows:
            line = f"| {r.method} | {r.n} | {r.mean:.4f} |"
            line += f" {_ci(r.ratio, '{:.2f}')}x |" if ratio else ""
            wlt = f"{r.wins}/{r.losses}/{r.ties}" if base else "–"
            line += f" {_ci(r.diff, '{:+.4f}')} | {wlt} | {r.verdict or '–'} |"
            lines.append(line)
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _intervals_md(rows_by_metric: dict[str, list[bootstrap.MethodComparison]]) -> str:
    if not any(rows_by_metric.values()):
        return ""
    return (
        "\n## Paired bootstrap 95 % intervals\n\n"
        f"- {bootstrap.RESAMPLES:,} resamples of the examples every method finished (seed "
        f"{bootstrap.SEED}, the same resamples for every method), percentile intervals. Ratio "
        "to reuse: the method's mean answer KL over reuse's on the same resampled examples. "
        "Diff: the method's mean minus the baseline's; wins: examples where the method is "
        "better (lower KL, higher EM). A method is called better or worse only when the "
        "difference's interval excludes 0.\n\n" + format_intervals(rows_by_metric) + "\n"
    )


def _report_md(config: dict[str, Any], methods: dict[str, dict[str, Any]]) -> str:
    model = config.get("model") or f"embedded ({config.get('model_name')})"
    return (
        "# blendkv eval\n\n"
        f"- data: `{config['data']}` ({config['num_examples']} examples), model: {model}, "
        f"dtype: {config['dtype']}\n"
        f"- greedy, max_tokens={config['max_tokens']}; fidelity vs full prefill, teacher-forced "
        f"along its first {config['answer_tokens']} answer tokens; blend selection "
        f"{config['selection']} (unless the method name gives another) at layer "
        f"{config['check_layer']}\n"
        "- TTFT measured interleaved per example after warming the chunk store; speedup = "
        "full's median TTFT / the method's. `recompute` = share of reused chunk tokens "
        "recomputed to the last layer (blend) or of prompt tokens computed (full, prefix, hf); "
        "`cost` = row-layers run / full prefill's (selection passes included). `prefix` reuses "
        "exact K/V, so its logit fidelity is full's (not re-measured); its answers and TTFT are "
        "its own. `within target`: the share of examples whose largest next-token KL over the "
        "first 16 answer tokens (teacher-forced, what `BlendConfig(fidelity_target=...)` bounds) "
        "is within `target` nats (a target promises 0.9); `greedy differs`: the share whose "
        "greedy answer is not full prefill's.\n\n" + format_table(methods) + "\n"
    )


def write_outputs(out_dir: str | Path, result, baseline: str | None = None) -> dict[str, Path]:
    """Write every output file of ``result`` (an ``EvalResult``) into ``out_dir``; the
    intervals compare every method with ``baseline`` (default: the run's default blend)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": out / "results.json",
        "per_example": out / "per_example.jsonl",
        "report": out / "report.md",
        "quality_vs_ttft": out / "quality_vs_ttft.png",
    }
    intervals = interval_rows(result.records, baseline)
    doc = {
        "config": result.config,
        "methods": result.summary,
        "intervals": {m: [r.as_dict() for r in rows] for m, rows in intervals.items()},
    }
    paths["results"].write_text(json.dumps(doc, indent=2) + "\n")
    with paths["per_example"].open("w") as f:
        for record in result.records:
            f.write(json.dumps(record) + "\n")
    report = _report_md(result.config, result.summary) + _intervals_md(intervals)
    notice = reference_notice(result.records)
    paths["report"].write_text(report + (f"\n{notice}.\n" if notice else ""))
    _plot_quality_vs_ttft(result.summary, paths["quality_vs_ttft"])
    sweeps = _blend_sweeps(result.summary)
    if sweeps:
        paths["pareto"] = out / "pareto.png"
        _plot_pareto(result.summary, sweeps, paths["pareto"])
    if any(sum(n.startswith("blend@") for _, n in points) >= 2 for points in sweeps.values()):
        paths["recompute_sweep"] = out / "recompute_sweep.png"
        _plot_sweep(result.summary, sweeps, paths["recompute_sweep"])
    if any(s.get("within_target") is not None for s in result.summary.values()):
        paths["tradeoff"] = out / "tradeoff.png"  # (journals of older runs lack the measure)
        _plot_tradeoff(result.summary, paths["tradeoff"])
    return paths


def _blend_sweeps(methods: dict[str, dict[str, Any]]) -> dict[str, list[tuple[float, str]]]:
    """Fusion strategy (``blend@R:STRATEGY``'s STRATEGY, ``v_deviation`` when none) -> its
    methods as sorted ``(R, name)``."""
    sweeps: dict[str, list[tuple[float, str]]] = {}
    for name in methods:
        if name.startswith("blend@"):
            blend = parse_method(name).blend
            strategy = name.partition(":")[2] or blend.selection
            sweeps.setdefault(strategy, []).append((blend.recompute_ratio, name))
    if "reuse" in methods:  # R = 0 is the same K/V under every strategy
        for points in sweeps.values():
            if all(r > 0.0 for r, _ in points):
                points.append((0.0, "reuse"))
    return {selection: sorted(points) for selection, points in sweeps.items()}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_quality_vs_ttft(methods: dict[str, dict[str, Any]], path: Path) -> None:
    """Two panels against median TTFT: F1 (task quality) and answer KL (fidelity to full
    prefill; a small model's F1 is often too low to rank methods, its KL is not)."""
    plt = _pyplot()
    fig, (ax_f1, ax_kl) = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        (ax_f1, "f1", "F1 (higher is better)"),
        (ax_kl, "answer_kl", "answer KL vs full prefill (lower is better)"),
    )
    for ax, key, label in panels:
        points = [(name, s["ttft_median_s"], s[key]) for name, s in methods.items()]
        # A label is ~15% of the x range wide and ~4% of the y range high.
        dx = 0.15 * (max(p[1] for p in points) - min(p[1] for p in points) or 1.0)
        dy = 0.04 * (max(p[2] for p in points) - min(p[2] for p in points) or 1.0)
        for i, (name, x, y) in enumerate(points):
            ax.scatter(x, y)
            # Stack the labels of points that (nearly) coincide, e.g. full and prefix.
            n = sum(abs(x - px) <= dx and abs(y - py) <= dy for _, px, py in points[:i])
            ax.annotate(
                name, (x, y), textcoords="offset points", xytext=(5, 4 + 10 * n), fontsize=8
            )
        ax.set_xlabel("median TTFT (s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("quality vs time to first token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_pareto(methods, sweeps: dict[str, list[tuple[float, str]]], path: Path) -> None:
    """Answer KL against median TTFT: one line per strategy through its ratios (labelled R),
    reuse and full prefill as single points. Lower-left is better."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = plt.cm.tab20.colors
    for i, (strategy, points) in enumerate(sweeps.items()):
        points = [(r, n) for r, n in points if n != "reuse"]
        xs = [methods[n]["ttft_median_s"] for _, n in points]
        ys = [methods[n]["answer_kl"] for _, n in points]
        style = "os^Dv"[i // len(colors) + i % 5] + "-"
        ax.plot(xs, ys, style, label=strategy, markersize=4, color=colors[i % len(colors)])
        for (r, _), x, y in zip(points, xs, ys, strict=True):
            ax.annotate(f"{r:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    for name, marker in (("reuse", "s"), ("full", "*")):
        if name in methods:
            s = methods[name]
            ax.scatter(
                s["ttft_median_s"],
                s["answer_kl"],
                marker=marker,
                s=80,
                color="k",
                zorder=3,
                label=name,
            )
    ax.set_xscale("log")  # full prefill sits far to the right of every blend
    ax.set_xlabel("median TTFT (s, log scale)")
    ax.set_ylabel("answer KL vs full prefill (nats, lower is better)")
    ax.grid(alpha=0.3)
    ax.legend(title="strategy (points: R)", fontsize=7)
    ax.set_title("fusion strategies: fidelity against time to first token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_sweep(methods, sweeps: dict[str, list[tuple[float, str]]], path: Path) -> None:
    """Answer KL (left) and F1 (right) against R, one line per selection strategy."""
    plt = _pyplot()
    fig, (ax_kl, ax_f1) = plt.subplots(1, 2, figsize=(11, 4.2))
    for selection, points in sweeps.items():
        ratios = [r for r, _ in points]
        ax_kl.plot(ratios, [methods[n]["answer_kl"] for _, n in points], "o-", label=selection)
        ax_f1.plot(ratios, [methods[n]["f1"] for _, n in points], "s--", label=selection)
    if "full" in methods:
        ax_f1.axhline(methods["full"]["f1"], color="gray", alpha=0.5, label="full prefill")
    for ax, label in ((ax_kl, "answer KL vs full prefill (nats)"), (ax_f1, "F1")):
        ax.set_xlabel("recompute ratio R")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(title="strategy", fontsize=8)
    fig.suptitle("blend recompute sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_tradeoff(methods: dict[str, dict[str, Any]], path: Path) -> None:
    """TTFT speedup over full prefill against the fraction of examples within the fidelity
    target, one point per method: ``target@T`` (the engine picks the ratio) as triangles, fixed
    ratios (``blend@R``, ``reuse``, ``default``) as circles, the others (full, prefix, hf) as
    squares. A point held to another target than most (``target@T`` by default: its own T)
    says so. A dotted line at 0.9, what a target promises. Upper-right is better."""
    from collections import Counter

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    kinds = {
        "fidelity target": ("^", "tab:red"),
        "fixed ratio": ("o", "tab:blue"),
        "no blend": ("s", "k"),
    }
    shown = {n: s for n, s in methods.items() if s.get("within_target") is not None}
    common = Counter(s["fidelity_target"] for s in shown.values()).most_common(1)[0][0]
    seen = set()
    for name, s in shown.items():
        method = parse_method(name)
        if method.fidelity_target is not None:
            kind = "fidelity target"
        else:
            kind = "fixed ratio" if method.kind == "blend" else "no blend"
        marker, color = kinds[kind]
        x, y = s["within_target"], s["ttft_speedup"]
        ax.scatter(x, y, marker=marker, color=color, s=50, label=None if kind in seen else kind)
        seen.add(kind)
        target = s["fidelity_target"]
        label = name if target == common else f"{name} (within {target:g})"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axvline(0.9, color="gray", linestyle=":", alpha=0.7, label="a target's promise (0.9)")
    ax.set_xlim(-0.05, 1.05)
    ax.set_xlabel(
        f"fraction of examples within {common:g} nats (largest next-token KL, 16 answer tokens)"
    )
    ax.set_ylabel("TTFT speedup vs full prefill (median)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("speed against fidelity: fixed ratios and fidelity targets")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
