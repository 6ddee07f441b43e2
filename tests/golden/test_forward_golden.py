"""The one forward path computes exactly what main computed before it (fp32, bit for bit).

Goldens were recorded by ``record.py`` on main before the refactor that merged the three layer
loops (model forward, blended prefill, chunk precompute) into one. Bits hold only for one CPU
kind (torch 2.13 CPU, 2 threads): MKL rounds differently on Intel and AMD CPUs of the same ISA,
so each kind has its own folder (:func:`capture.cpu_kind`). On a CPU kind with no set, the tiny
models are compared with another kind's set within fp32 rounding (1e-4), and the embedded
model (stored as hashes only) is skipped with the reason. GEMMs run through MKL
(``BLENDKV_CPU_GEMM=mkl``) with the torch reference attention, as when the goldens were
recorded; oneDNN's are checked against transformers elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash
from capture import capture, cpu_kind, golden_llm
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
KINDS = sorted(p.name for p in HERE.iterdir() if p.is_dir() and (p / "embedded.json").exists())
# Between CPU kinds the captured tensors measured <= 3.6e-6 apart (tiny models, Intel vs AMD).
CROSS_KIND_ATOL = 1e-4


def _golden_dir() -> tuple[Path, bool]:
    """This CPU kind's set (exact), else the first recorded one (compared within rounding)."""
    assert KINDS, "no golden sets recorded"
    kind = cpu_kind()
    return (HERE / kind, True) if kind in KINDS else (HERE / KINDS[0], False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_models_bit_identical(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    folder, exact = _golden_dir()
    want = load_file(str(folder / f"tiny_{arch}.safetensors"))
    with golden_llm(str(path)) as llm:
        got = capture(llm)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        diff = (got[name].double() - want[name].double()).abs().max().item()
        if exact:
            assert torch.equal(got[name], want[name]), f"{name}: max abs diff {diff:.3g}"
        elif name.endswith(".tokens"):
            assert torch.equal(got[name], want[name]), name
        else:
            assert diff <= CROSS_KIND_ATOL, f"{name}: max abs diff {diff:.3g} ({folder.name})"


def test_embedded_model_bit_identical():
    folder, exact = _golden_dir()
    if not exact:
        pytest.skip(
            f"no goldens for this CPU kind ({cpu_kind()}; recorded: {', '.join(KINDS)}): "
            "record them with tests/golden/record.py --embedded on a known-good commit"
        )
    want = json.loads((folder / "embedded.json").read_text())
    with golden_llm() as llm:
        got = capture(llm)
    assert sorted(got) == sorted(want)
    for name, entry in want.items():
        t = got[name].contiguous()
        assert list(t.shape) == entry["shape"], name
        assert xxhash.xxh3_128_hexdigest(t.numpy().tobytes()) == entry["xxh3"], name


def test_cpu_kinds_agree_within_rounding():
    """The recorded sets of different CPU kinds are the same numbers up to fp32 rounding."""
    for arch in ("llama", "qwen2"):
        sets = [load_file(str(HERE / kind / f"tiny_{arch}.safetensors")) for kind in KINDS]
        for other in sets[1:]:
            assert sorted(other) == sorted(sets[0])
            for name, t in sets[0].items():
                diff = (other[name].double() - t.double()).abs().max().item()
                assert diff <= CROSS_KIND_ATOL, f"{arch} {name}: {diff:.3g}"
