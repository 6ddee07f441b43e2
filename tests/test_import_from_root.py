"""transformers, then blendkv, imported from the repository root.

transformers probes for a top-level ``kernels`` package (the Hugging Face kernels hub); from the
repository root it finds this repository's ``kernels/`` folder (``blendkv.kernels``). That
folder's ``__init__`` must import nothing, or the probe imports blendkv half-way through
importing transformers and the two import each other in a circle.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_transformers_then_blendkv_from_the_repository_root():
    script = "from transformers import LlamaForCausalLM; import blendkv; print('ok')"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_the_kernels_package_imports_nothing():
    tree = compile((ROOT / "kernels" / "__init__.py").read_text(), "__init__.py", "exec")
    assert not any(name in ("IMPORT_NAME", "IMPORT_FROM") for name in _opnames(tree))


def _opnames(code) -> list[str]:
    import dis

    return [ins.opname for ins in dis.get_instructions(code)]
