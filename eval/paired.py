"""Paired comparison of ``blendkv eval`` runs against a baseline run, example by example.

    python -m blendkv.eval.paired BASE_DIR NAME=RUN_DIR [...] [--metric answer_kl] [--with-full]

For every method both runs hold, over the examples both finished: the run's mean metric, its
ratio to the baseline's mean on the same examples, on how many examples it is lower and higher,
the two-sided exact sign test's p-value over the examples that differ (ties dropped), and the
paired bootstrap 95 % interval of the mean difference (:mod:`blendkv.eval.bootstrap`): a run is
called lower or higher only when that interval excludes 0. Used
for runs that differ in a setting the method name does not show (``--anchor``,
``--anchor-boundary``, ``--chunk-order``), against a journal of the same methods under the
default setting. ``full`` is the reference of the fidelity metrics and is left out, unless
``--with-full`` (a setting that changes the prompt, like ``--chunk-order``, changes it too).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from blendkv.eval.bootstrap import bootstrap_indices


def load_records(run_dir: str | Path) -> dict[tuple[str, str], dict]:
    """(example id, method) -> record, from a run's ``per_example.jsonl``."""
    path = Path(run_dir) / "per_example.jsonl"
    records = {}
    with path.open() as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                records[(r["id"], r["method"])] = r
    return records


def sign_test(lower: int, higher: int) -> float:
    """Two-sided exact sign test: the chance of a split at least this uneven between ``lower``
    and ``higher`` if either were equally likely (1.0 when no example differs)."""
    n = lower + higher
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lower, higher) + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(base: dict, run: dict, metric: str, with_full: bool = False) -> list[dict]:
    """One row per method the two runs share (``full`` left out unless ``with_full``: it is
    the reference)."""
    rows = []
    methods = sorted(
        {m for _, m in run} & {m for _, m in base} - (set() if with_full else {"full"})
    )
    for method in methods:
        ids = [i for i, m in run if m == method and (i, method) in base]
        if not ids:
            continue
        ours = statistics.mean(run[(i, method)][metric] for i in ids)
        theirs = statistics.mean(base[(i, method)][metric] for i in ids)
        lower = sum(run[(i, method)][metric] < base[(i, method)][metric] for i in ids)
        higher = sum(run[(i, method)][metric] > base[(i, method)][metric] for i in ids)
        low, high = _diff_interval(
            [run[(i, method)][metric] - base[(i, method)][metric] for i in ids]
        )
        rows.append(
            {
                "method": method,
                "n": len(ids),
                "mean": ours,
                "base_mean": theirs,
                "lower": lower,
                "higher": higher,
                "p": sign_test(lower, higher),
                "diff_low": low,
                "diff_high": high,
                "called": "lower" if high < 0 else "higher" if low > 0 else "no difference",
            }
        )
    return rows


def _diff_interval(diffs: list[float]) -> tuple[float, float]:
    """The percentile 95 % interval of the mean paired difference (bootstrap, seeded)."""
    import numpy as np

    d = np.asarray(diffs, dtype=float)
    means = d[bootstrap_indices(len(d))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return float(low), float(high)


def format_rows(name: str, rows: list[dict], metric: str) -> str:
    lines = []
    for r in rows:
        ratio = r["mean"] / r["base_mean"] if r["base_mean"] else float("nan")
        lines.append(
            f"| {name} | {r['method']} | {r['n']} | {r['mean']:.4f} | {r['base_mean']:.4f} | "
            f"{ratio:.2f}x | {r['lower']}/{r['n']} | {r['higher']}/{r['n']} | {r['p']:.3f} | "
            f"[{r['diff_low']:+.4f}, {r['diff_high']:+.4f}] | {r['called']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blendkv.eval.paired", description=__doc__)
    p.add_argument("base", help="the baseline run's --out directory")
    p.add_argument("runs", nargs="+", metavar="NAME=DIR", help="runs to compare with it")
    p.add_argument("--metric", default="answer_kl", help="a per-example key (default answer_kl)")
    p.add_argument("--with-full", action="store_true", help="compare full prefill's rows too")
    args = p.parse_args(argv)
    base = load_records(args.base)
    m = args.metric
    print(
        f"| run | method | n | {m} | baseline | ratio | lower on | higher on | sign p | "
        "diff 95% CI | called |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep:
            p.error(f"{spec!r}: write NAME=DIR")
        print(format_rows(name, compare(base, load_records(path), m, args.with_full), m))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
