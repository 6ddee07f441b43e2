"""Where blendkv keeps what it makes once per machine (converted models, built C++ kernels).

A leaf module (standard library only), so the model loader and the kernel builder both import
it without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` if given, else ``$BLENDKV_CACHE``, else ``~/.cache/blendkv``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("BLENDKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "blendkv"
