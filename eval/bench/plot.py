"""The benchmarks page's plots, redrawn from saved result files.

    blendkv bench plot [--eval RUN_DIR ...] [--ttft BENCH_JSON ...] --out DIR

``--eval``: a ``blendkv eval --out`` folder (its ``results.json``): answer KL against the
recompute ratio, one line per fusion strategy (``recompute_sweep``), answer KL against TTFT
(``pareto``), and TTFT speedup against the share of examples within the fidelity target
(``tradeoff``), drawn by the evaluation report's own code (:mod:`blendkv.eval.report`).
``--ttft``: a ``blendkv bench gpu --json`` file: time to first token against prompt length, full
prefill, the default blend and reuse, one panel per model shape (``ttft_vs_length``). Each
plot is written to ``DIR/<name>_<kind>.png``, ``<name>`` the run folder's or file's stem.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from blendkv.eval.report import (
    _blend_sweeps,
    _plot_pareto,
    _plot_sweep,
    _plot_tradeoff,
    _pyplot,
)


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for run in args.eval or []:
        written += plot_eval(Path(run), out)
    for path in args.ttft or []:
        written.append(plot_ttft(Path(path), out))
    if not written:
        raise SystemExit("nothing to plot: give --eval RUN_DIR and/or --ttft BENCH_JSON")
    for path in written:
        print(path)
    return 0


def plot_eval(run: Path, out: Path) -> list[Path]:
    """The sweep and pareto plots of an eval run folder (where it has a sweep), and its
    trade-off plot (where it measured the share within a target)."""
    methods = json.loads((run / "results.json").read_text())["methods"]
    sweeps = _blend_sweeps(methods)
    written = []
    if sweeps:
        path = out / f"{run.name}_pareto.png"
        _plot_pareto(methods, sweeps, path)
        written.append(path)
    if any(sum(n.startswith("blend@") for _, n in points) >= 2 for points in sweeps.values()):
        path = out / f"{run.name}_recompute_sweep.png"
        _plot_sweep(methods, sweeps, path)
        written.append(path)
    if any(s.get("within_target") is not None for s in methods.values()):
        path = out / f"{run.name}_tradeoff.png"
        _plot_tradeoff(methods, path)
        written.append(path)
    return written


def plot_ttft(path: Path, out: Path) -> Path:
    """TTFT against prompt tokens (full, default blend, reuse), one panel per shape."""
    data = json.loads(path.read_text())  # bench gpu --json: a list of per-shape rows
    rows = [r for r in (data if isinstance(data, list) else data["rows"]) if r.get("blend")]
    if not rows:
        raise SystemExit(f"{path}: no blended prompt sizes (bench gpu --blend-prompts)")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 4.2), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        sizes = sorted(row["blend"], key=lambda s: s["tokens"])
        tokens = [s["tokens"] for s in sizes]
        for key, label, style in (
            ("full_s", "full prefill", "k*-"),
            ("blend_s", "default blend", "o-"),
            ("reuse_s", "reuse (R = 0)", "s--"),
        ):
            ax.plot(tokens, [s[key] * 1e3 for s in sizes], style, label=label)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title(f"{row['shape']} ({row['dtype']}, {row['device']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    target = out / f"{path.stem}_ttft_vs_length.png"
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target
