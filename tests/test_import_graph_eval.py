"""The engine never imports the evaluation harness: the dependency runs ``blendkv.eval`` ->
``blendkv`` only.

Every module of the installed package except ``blendkv.eval`` (the source folders ``blendkv/``,
``kernels/`` and ``store/``) is parsed with :mod:`ast`; every import counts, module-level or
inside a function, as do ``importlib.import_module("...")`` and ``__import__("...")`` calls with a
string literal. The ``eval`` and ``bench`` commands reach the CLI through the
``blendkv.commands`` entry-point group instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {"blendkv": "blendkv", "kernels": "blendkv.kernels", "store": "blendkv.store"}
FORBIDDEN = "blendkv.eval"


def _modules() -> list[tuple[Path, str]]:
    """(file, dotted package the file's relative imports resolve against) for every module."""
    out = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            # A module's relative imports resolve against its package (an __init__'s: its own).
            out.append((path, ".".join(package.split(".") + list(rel[:-1]))))
    return out


def _resolve(package: str, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported_names(source: str, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``source``, relative ones resolved."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(package, node.level, node.module)
            names.append((node.lineno, target))
            if not _is_eval(target):  # `from blendkv import eval` names the subpackage itself
                names += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                if isinstance(arg.value, str):
                    names.append((node.lineno, _resolve(package, 0, arg.value)))
    return names


def _is_eval(name: str) -> bool:
    return name == FORBIDDEN or name.startswith(FORBIDDEN + ".")


def test_finder_sees_function_level_and_dynamic_imports():
    source = (
        "def f():\n"
        "    from blendkv.eval.metrics import x\n"
        "    import importlib\n"
        "    importlib.import_module('blendkv.eval.runner')\n"
        "from .. import eval\n"
    )
    found = sorted(n for _, n in imported_names(source, "blendkv.rag") if _is_eval(n))
    assert found == ["blendkv.eval", "blendkv.eval.metrics", "blendkv.eval.runner"]


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_no_module_imports_the_eval_harness(folder):
    modules = [(p, pkg) for p, pkg in _modules() if p.is_relative_to(ROOT / folder)]
    assert modules, f"no modules found under {folder}/"
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path, package in modules
        for line, name in imported_names(path.read_text(), package)
        if _is_eval(name)
    ]
    assert not bad, "blendkv must not import blendkv.eval:\n" + "\n".join(bad)
