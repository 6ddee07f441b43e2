"""Quality and TTFT of blending against full prefill on MuSiQue questions, with ``blendkv eval``.

    .venv/bin/python examples/eval_musique.py [--data FILE] [--limit N] [--out DIR]

By default it runs the two MuSiQue dev examples bundled with the tests
(``tests/data/musique_dev_first2.json``: 4 passages each, ~2.4K-token prompts) through full
prefill, full reuse and a blend at ratio 0.1 (``blend@0.1``: ProphetKV with the K correction), in
float32; a few minutes on two CPU cores. For the benchmark's setting give CacheBlend's
MuSiQue file (``--data musique_dev.json --limit 50``: 10 passages, ~6K tokens; ten examples
through five methods take about 50 minutes on two cores). ``blendkv eval --help`` lists every
option; the report is ``OUT/report.md``.

MuSiQue (Trivedi et al., 2022) is CC BY 4.0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blendkv.cli import main

BUNDLED = Path(__file__).resolve().parents[1] / "tests" / "data" / "musique_dev_first2.json"

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(BUNDLED), help="CacheBlend-format MuSiQue JSON")
    parser.add_argument("--limit", type=int, default=2, help="the first N examples")
    parser.add_argument("--out", default="bench_out/eval-musique")
    args = parser.parse_args()
    sys.exit(
        main(
            [
                "eval",
                "--data",
                args.data,
                "--limit",
                str(args.limit),
                "--methods",
                "full,reuse,blend@0.1",
                "--dtype",
                "float32",
                "--max-tokens",
                "32",
                "--out",
                args.out,
            ]
        )
    )
