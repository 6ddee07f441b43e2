"""Quality/latency of blending on MuSiQue dev (CacheBlend format) with ``blendkv eval``.

    .venv/bin/python examples/eval_musique.py [path/to/musique_dev.json] [OUT_DIR]

Compares full prefill, prefix caching, full reuse and blending at two recompute ratios on the
first 10 examples; see ``blendkv eval --help`` for every option.
"""

from __future__ import annotations

import sys
from pathlib import Path

from blendkv.cli import main

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_dev.json"

if __name__ == "__main__":
    data = sys.argv[1] if len(sys.argv) > 1 else str(DEFAULT_DATA)
    out = sys.argv[2] if len(sys.argv) > 2 else "bench_out/eval-musique"
    sys.exit(
        main(
            [
                "eval",
                "--data",
                data,
                "--limit",
                "10",
                "--methods",
                "full,prefix,reuse,blend@0.15,blend@0.3",
                "--dtype",
                "float32",
                "--max-tokens",
                "32",
                "--out",
                out,
            ]
        )
    )
