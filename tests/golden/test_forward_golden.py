"""The one forward path computes exactly what main computed before it (fp32, bit for bit).

Goldens were recorded by ``record.py`` on main before the refactor that merged the three layer
loops (model forward, blended prefill, chunk precompute) into one. They hold for this machine
kind (CI's: x86-64, torch 2.13 CPU, 2 threads); another CPU or BLAS build may round
differently, and then only ``record.py`` on a known-good commit makes new ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash
from capture import capture
from safetensors.torch import load_file

from blendkv import LLM

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_models_bit_identical(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    want = load_file(str(HERE / f"tiny_{arch}.safetensors"))
    with LLM(
        str(path), dtype="float32", block_size=4, num_threads=2, enable_prefix_caching=False
    ) as llm:
        got = capture(llm)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        diff = (got[name].double() - want[name].double()).abs().max().item()
        assert torch.equal(got[name], want[name]), f"{name}: max abs diff {diff:.3g}"


def test_embedded_model_bit_identical():
    want = json.loads((HERE / "embedded.json").read_text())
    with LLM(dtype="float32", block_size=16, num_threads=2, enable_prefix_caching=False) as llm:
        got = capture(llm)
    assert sorted(got) == sorted(want)
    for name, entry in want.items():
        t = got[name].contiguous()
        assert list(t.shape) == entry["shape"], name
        assert xxhash.xxh3_128_hexdigest(t.numpy().tobytes()) == entry["xxh3"], name
