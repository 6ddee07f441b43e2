"""``blendkv --help`` (and every command's) parses without importing torch or transformers
(seconds of imports for a help text); ``blendkv.LLM`` is imported on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "faiss", "lmdb")
_SCRIPT = """
import sys
from blendkv.cli import main
try:
    main({argv!r})
except SystemExit as exit:
    assert exit.code == 0, exit.code
print("heavy:", ",".join(n for n in {heavy!r} if n in sys.modules))
"""


@pytest.mark.parametrize(
    "argv", [["--help"], ["ingest", "--help"], ["ask", "--help"], ["serve", "--help"]]
)
def test_help_imports_no_torch(argv):
    script = _SCRIPT.format(argv=argv, heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: blendkv" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "heavy:", done.stdout[-500:]


def test_every_command_registers_without_torch():
    script = (
        "import sys\nfrom blendkv.cli import build_parser\n"
        "p = build_parser()\n"
        "names = p._subparsers._group_actions[0].choices\n"
        "print(sorted(names))\n"
        f"print([n for n in {HEAVY!r} if n in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names, heavy = done.stdout.strip().splitlines()[-2:]
    assert all(f"'{c}'" in names for c in ("ask", "eval", "bench", "ingest", "serve", "store"))
    assert heavy == "[]"


def test_llm_is_imported_on_first_use():
    script = (
        "import sys, blendkv\nassert 'torch' not in sys.modules\n"
        "from blendkv import LLM\nassert LLM.__name__ == 'LLM' and 'torch' in sys.modules\n"
        "print(blendkv.LLM is LLM)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
