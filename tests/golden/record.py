"""Record the forward-path goldens (run once, on main before the refactor).

python tests/golden/record.py [--embedded]
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

from capture import capture  # noqa: E402
from helpers import make_tiny_model_dir  # noqa: E402

from blendkv import LLM  # noqa: E402


def chunk_kv_before_refactor(llm, ids):
    manager = llm.blend_manager()
    manager.flush()  # query-time misses are written in the background
    return manager.store.get(manager.chunk_key(ids)).kv.clone()


def query_start_before_refactor(llm, prompt):
    return llm.blend_manager().prepare(prompt, None).prompt.query_start


def digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.contiguous().numpy().tobytes())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--embedded", action="store_true")
    args = p.parse_args()
    import tempfile

    if args.embedded:
        llm = LLM(dtype="float32", block_size=16, num_threads=2, enable_prefix_caching=False)
        got = capture(llm, chunk_kv_before_refactor, query_start_before_refactor)
        llm.close()
        data = {k: {"xxh3": digest(v), "shape": list(v.shape)} for k, v in got.items()}
        (HERE / "embedded.json").write_text(json.dumps(data, indent=1) + "\n")
        return
    for arch in ("llama", "qwen2"):
        with tempfile.TemporaryDirectory() as d:
            path = make_tiny_model_dir(Path(d), arch)
            llm = LLM(
                str(path),
                dtype="float32",
                block_size=4,
                num_threads=2,
                enable_prefix_caching=False,
            )
            got = capture(llm, chunk_kv_before_refactor, query_start_before_refactor)
            llm.close()
        save_file(got, str(HERE / f"tiny_{arch}.safetensors"))


if __name__ == "__main__":
    main()
