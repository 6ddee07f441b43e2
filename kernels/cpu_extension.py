"""Building and loading blendkv's C++ CPU kernels (``torch.ops.blendkv_cpu``).

The sources (``kernels/cpu/decode_attention.cpp``, ``rows_attention.cpp``, ``rope_write.cpp``,
``chunk_shift.cpp``) are compiled into one library on first use with the machine's C++ compiler
(``$CXX``, else ``c++`` / ``g++`` / ``clang++``) against the installed torch, for this CPU
(``-march=native``), into ``<cache>/extensions/`` (``$BLENDKV_CACHE``, else
``~/.cache/blendkv``); later processes load the cached library. The file name hashes the
sources, the torch version, the compiler, the flags and the CPU's model and feature flags, so a
changed source, torch or machine builds afresh and a home directory shared by two kinds of CPU
never loads code built for the other. One compiler call, no ninja.

``torch.utils.cpp_extension.load`` is not used: it needs ninja, which blendkv does not depend
on. The include and library paths still come from ``torch.utils.cpp_extension``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from blendkv.paths import default_cache_dir

logger = logging.getLogger(__name__)

_CPU_DIR = Path(__file__).resolve().parent / "cpu"
SOURCES = tuple(
    _CPU_DIR / name
    for name in ("decode_attention.cpp", "rows_attention.cpp", "rope_write.cpp", "chunk_shift.cpp")
)
HEADERS = (
    _CPU_DIR / "tasks.h",
    _CPU_DIR / "bf16.h",
)  # included by the sources: part of the cache key
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c++20")


class CPUKernelBuildError(RuntimeError):
    """The C++ CPU kernels could not be built or loaded; the message says why."""


def find_compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """The CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _library_path(compiler: str, torch_version: str, cache_dir: Path) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    h = hashlib.sha256()
    sources = [src.read_bytes() for src in (*SOURCES, *HEADERS)]
    for part in (*sources, torch_version.encode(), version.encode(), *FLAGS):
        h.update(part if isinstance(part, bytes) else part.encode())
    h.update(_cpu_signature().encode())
    return cache_dir / f"blendkv_cpu_{h.hexdigest()[:16]}.so"


def build(cache_dir: Path | None = None) -> Path:
    """The path of the built library, compiling it unless a matching one is cached."""
    import torch

    compiler = find_compiler()
    if compiler is None:
        raise CPUKernelBuildError("no C++ compiler found (set $CXX or install g++)")
    cache_dir = cache_dir or default_cache_dir() / "extensions"
    try:
        path = _library_path(compiler, torch.__version__, cache_dir)
        return path if path.exists() else _compile(compiler, path)
    except OSError as exc:  # an unwritable cache, a compiler that vanished, ...
        raise CPUKernelBuildError(
            f"building into {cache_dir} failed: {exc} (set BLENDKV_CACHE to a writable directory)"
        ) from exc


def _compile(compiler: str, path: Path) -> Path:
    import torch
    from torch.utils import cpp_extension

    cache_dir = path.parent
    cache_dir.mkdir(parents=True, exist_ok=True)
    abi = int(torch.compiled_with_cxx11_abi())
    cmd = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [str(src) for src in SOURCES]
    lib_dirs = cpp_extension.library_paths()
    cmd += [f"-L{p}" for p in lib_dirs] + [f"-Wl,-rpath,{p}" for p in lib_dirs]
    cmd += ["-lc10", "-ltorch_cpu", "-ltorch"]
    logger.info("building blendkv's C++ CPU kernels into %s (once per machine and torch)", path)
    # Build into a temporary file and rename: concurrent processes never load half a library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        done = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            names = ", ".join(src.name for src in SOURCES)
            raise CPUKernelBuildError(f"compiling {names} failed:\n{tail}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def load_ops():
    """``torch.ops.blendkv_cpu``, built and loaded once per process (torch's operator
    registry is process-wide: a library registers its namespace once). A cached library that
    does not load (truncated by a full disk, say) is built again, once."""
    import torch

    for attempt in range(2):
        path = build()
        try:
            torch.ops.load_library(str(path))
            return torch.ops.blendkv_cpu
        except (OSError, RuntimeError) as exc:
            if attempt == 1:
                raise CPUKernelBuildError(f"loading {path} failed: {exc}") from exc
            logger.warning("cached CPU kernels %s do not load (%s); building them again", path, exc)
            path.unlink(missing_ok=True)
