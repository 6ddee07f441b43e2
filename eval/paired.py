"""Paired comparison of ``blendkv eval`` runs against a baseline run, example by example.

    python -m blendkv.eval.paired BASE_DIR NAME=RUN_DIR [NAME=RUN_DIR ...] [--metric answer_kl]

For every method both runs hold, over the examples both finished: the run's mean metric, its
ratio to the baseline's mean on the same examples, and on how many examples it is lower. Used
for runs that differ in a setting the method name does not show (``--anchor``,
``--anchor-boundary``), against a journal of the same methods under the default setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


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


def compare(base: dict, run: dict, metric: str) -> list[dict]:
    """One row per method the two runs share (``full`` left out: it is the reference)."""
    rows = []
    methods = sorted({m for _, m in run} & {m for _, m in base} - {"full"})
    for method in methods:
        ids = [i for i, m in run if m == method and (i, method) in base]
        if not ids:
            continue
        ours = statistics.mean(run[(i, method)][metric] for i in ids)
        theirs = statistics.mean(base[(i, method)][metric] for i in ids)
        lower = sum(run[(i, method)][metric] < base[(i, method)][metric] for i in ids)
        rows.append(
            {"method": method, "n": len(ids), "mean": ours, "base_mean": theirs, "lower": lower}
        )
    return rows


def format_rows(name: str, rows: list[dict], metric: str) -> str:
    lines = []
    for r in rows:
        ratio = r["mean"] / r["base_mean"] if r["base_mean"] else float("nan")
        lines.append(
            f"| {name} | {r['method']} | {r['n']} | {r['mean']:.4f} | {r['base_mean']:.4f} | "
            f"{ratio:.2f}x | {r['lower']}/{r['n']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blendkv.eval.paired", description=__doc__)
    p.add_argument("base", help="the baseline run's --out directory")
    p.add_argument("runs", nargs="+", metavar="NAME=DIR", help="runs to compare with it")
    p.add_argument("--metric", default="answer_kl", help="a per-example key (default answer_kl)")
    args = p.parse_args(argv)
    base = load_records(args.base)
    m = args.metric
    print(f"| run | method | n | {m} | baseline | ratio | lower on |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep:
            p.error(f"{spec!r}: write NAME=DIR")
        print(format_rows(name, compare(base, load_records(path), m), m))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
