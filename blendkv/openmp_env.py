"""How torch's OpenMP threads wait, set on ``import blendkv`` before torch loads its runtime.

At the end of every parallel region libgomp's threads spin (300,000 rounds by default) before
they sleep. On a CPU the engine has to itself that is fastest. Beside any other busy process
it is a collapse: a thread that finished spins on its core while the thread it waits for is
queued behind the other process, and every region (thousands a decode step) waits for the
scheduler: decode is many times slower (``blendkv bench threads``; docs/benchmarks.md). A
short spin keeps most of the idle speed and little of the collapse.

The libgomp that torch bundles reads these variables once, when torch is imported, so this
takes effect when ``blendkv`` is imported first (the CLI and the server always do) and for
processes started from here. A user's ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is left as is.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "2000"  # libgomp spin rounds before a waiting thread sleeps (its default: 300000)


def set_openmp_defaults(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``GOMP_SPINCOUNT`` unless the user chose a wait policy; True when it was set."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
