"""Record the forward-path goldens.

    python tests/golden/record.py [--embedded]

The goldens were first recorded on main at 28d1ba7, before the one-forward-path refactor (then
through ``llm.engine.blend_manager()``), and re-recorded once since, for the CPU attention
rewrite that moved fp32 rounding by ~1e-6 (split prefix/band attention for scattered rows,
query heads folded per KV head in decode; both checked against a float64 oracle in
``tests/engine/test_torch_attention.py``), and again for in-place CPU decode (one flash call
per decode row over slices of the pool instead of a padded gather: decode logprobs moved by
<= 2.6e-6, nothing else; checked against the same oracle). Re-record only for a change meant to
alter the numbers, and say so in its commit.

Each CPU kind has its own set (``<arch>-<vendor>-<ISA>/``, :func:`capture.cpu_kind`): MKL rounds
differently on Intel and AMD. The AMD set was recorded at 481c3be after checking that 481c3be
and c40e45e (the last re-recording, on Intel) capture bit-identical tensors on that AMD CPU.
A new CPU kind gets its set from a known-good commit the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from capture import capture, cpu_kind, golden_llm  # noqa: E402
from helpers import make_tiny_model_dir  # noqa: E402


def digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.contiguous().numpy().tobytes())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--embedded", action="store_true")
    args = p.parse_args()
    import tempfile

    out = HERE / cpu_kind()
    out.mkdir(exist_ok=True)

    if args.embedded:
        llm = golden_llm()
        got = capture(llm)
        llm.close()
        data = {k: {"xxh3": digest(v), "shape": list(v.shape)} for k, v in got.items()}
        (out / "embedded.json").write_text(json.dumps(data, indent=1) + "\n")
        return
    for arch in ("llama", "qwen2"):
        with tempfile.TemporaryDirectory() as d:
            path = make_tiny_model_dir(Path(d), arch)
            llm = golden_llm(str(path))
            got = capture(llm)
            llm.close()
        save_file(got, str(out / f"tiny_{arch}.safetensors"))


if __name__ == "__main__":
    main()
