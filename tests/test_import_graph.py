"""The project's import graph has no cycles and the engine never reaches the blend package.

Every module of the installed ``blendkv`` package is parsed with ``ast`` (no import runs), from
the source folders that ``[tool.setuptools] package-dir`` in ``pyproject.toml`` maps to it. An
edge ``a -> b`` is any import of project module ``b`` in ``a``, function-level ones included,
since a cycle hidden in a function still ties the two modules together. ``if TYPE_CHECKING:``
blocks never run and are skipped. Importing ``pkg.mod`` counts as an edge to ``pkg.mod`` only,
not to ``pkg``'s ``__init__``: a package that is being initialised is already in ``sys.modules``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "blendkv"
# What pyproject.toml's package-dir says; read from it where tomllib exists (Python 3.11+).
DEFAULT_PACKAGE_DIR = {
    "blendkv": "blendkv",
    "blendkv.kernels": "kernels",
    "blendkv.store": "store",
    "blendkv.eval": "eval",
}


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line`` of ``source``'s file."""

    source: str
    target: str
    line: int


def package_dirs() -> dict[str, Path]:
    """Package name -> source folder, from ``pyproject.toml``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        mapping = DEFAULT_PACKAGE_DIR
    else:
        with open(ROOT / "pyproject.toml", "rb") as f:
            mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def module_files() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (``__init__.py`` for a package)."""
    dirs = package_dirs()
    # Folders mapped to their own package name are walked as that package, not as a subfolder
    # of another package's folder.
    claimed = {folder.resolve() for folder in dirs.values()}
    modules: dict[str, Path] = {}
    for name, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if any(p in ("__pycache__",) or p.startswith(".") for p in rel.parts):
                continue
            parents = [folder.joinpath(*rel.parts[:i]) for i in range(1, len(rel.parts))]
            if any(p.resolve() in claimed for p in parents):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([name, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """All import statements, at any depth, outside ``if TYPE_CHECKING:`` bodies."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest project module that ``name`` (a dotted name) is or lies inside."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import of a project module by a project module (resolved, deduplicated by line)."""
    edges: list[Edge] = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    package = module if is_package else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{node.module}" if node.module else package
                else:
                    base = node.module or ""
                for alias in node.names:
                    # ``from pkg import submodule`` imports the submodule; otherwise a name of pkg.
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                owner = _owner(target, modules)
                if owner is not None and owner != module:
                    edges.append(Edge(module, owner, node.lineno))
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _chain(start: str, members: set[str], lines: dict[tuple[str, str], int]) -> str:
    """A shortest cycle through ``start`` inside ``members``, as ``a:12 -> b:3 -> a``."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for source, target in lines:
                if source != node or target not in members:
                    continue
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    path.reverse()
                    path.append(start)
                    hops = [f"{a} (line {lines[(a, b)]})" for a, b in zip(path, path[1:])]  # noqa: B905
                    return " -> ".join([*hops, start])
                if target not in previous and target != start:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def graph_and_lines() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    modules = module_files()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    lines: dict[tuple[str, str], int] = {}
    for edge in import_edges(modules):
        graph[edge.source].add(edge.target)
        lines.setdefault((edge.source, edge.target), edge.line)
    return graph, lines


def test_walk_finds_the_package() -> None:
    modules = module_files()
    for name in (
        "blendkv",
        "blendkv.engine.scheduler",
        "blendkv.kernels",
        "blendkv.store.base",
        "blendkv.eval",
    ):
        assert name in modules, name


def test_edges_include_function_level_imports_but_not_type_checking(tmp_path: Path) -> None:
    files = {
        "p": "",
        "p.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import c\n"
        "def f():\n    from .b import name\n",
        "p.b": "import os\nfrom . import c\n",
        "p.c": "import p.a\nfrom p import b as _b\n",
    }
    modules = {}
    for name, text in files.items():
        path = tmp_path / (name.replace(".", "_") + ("/__init__.py" if name == "p" else ".py"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        modules[name] = path
    edges = {(e.source, e.target, e.line) for e in import_edges(modules)}
    assert edges == {("p.a", "p.b", 5), ("p.b", "p.c", 2), ("p.c", "p.a", 1), ("p.c", "p.b", 2)}


def test_cycle_finder_reports_a_chain() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    lines = {("a", "b"): 1, ("b", "c"): 2, ("c", "a"): 3, ("d", "a"): 4}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]
    assert _chain("a", {"a", "b", "c"}, lines) == "a (line 1) -> b (line 2) -> c (line 3) -> a"


def test_no_module_cycles() -> None:
    graph, lines = graph_and_lines()
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    report = [
        f"{len(c)} modules: {', '.join(c)}\n    e.g. {_chain(c[0], set(c), lines)}" for c in cycles
    ]
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(report)


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reaching(graph: dict[str, set[str]], sources: str, targets: str) -> list[str]:
    """For each module of package ``sources`` that imports its way (transitively) into package
    ``targets``: one such chain, ``a -> b -> c``."""
    chains = []
    for module in sorted(m for m in graph if _in(m, sources)):
        previous = {module: module}
        frontier = [module]
        found = None
        while frontier and found is None:
            node = frontier.pop()
            for target in sorted(graph[node]):
                if target in previous:
                    continue
                previous[target] = node
                if _in(target, targets):
                    found = target
                    break
                frontier.append(target)
        if found is not None:
            path = [found]
            while path[-1] != module:
                path.append(previous[path[-1]])
            chains.append(" -> ".join(reversed(path)))
    return chains


def test_reaching_finds_a_chain() -> None:
    graph = {"a.x": {"b"}, "b": {"c.y"}, "c.y": set(), "ab": {"c.y"}}
    assert reaching(graph, "a", "c") == ["a.x -> b -> c.y"]


def test_engine_never_imports_blend() -> None:
    """No engine module reaches ``blendkv.blend`` through imports, function-level ones included.

    The blend connector plugs into the engine through ``KVConnectorBase``; the engine knows only
    that interface (``tests/engine/test_kv_connector.py`` checks the same at run time).
    """
    graph, _ = graph_and_lines()
    bad = reaching(graph, "blendkv.engine", "blendkv.blend")
    assert not bad, "the engine reaches blendkv.blend:\n" + "\n".join(bad)


def test_rag_never_imports_the_server() -> None:
    """The server depends on ``blendkv.rag`` (``--store``), never the reverse; rag drives the
    model through ``blendkv.entrypoints.llm``."""
    graph, _ = graph_and_lines()
    bad = reaching(graph, "blendkv.rag", "blendkv.entrypoints.openai")
    assert not bad, "blendkv.rag reaches the server:\n" + "\n".join(bad)
    assert "blendkv.rag" in graph["blendkv.entrypoints.openai.api_server"]


def test_the_blend_algorithm_is_a_library():
    """``blendkv.blend`` (selection, ProphetKV's scores, corrections, the row plan) works on
    tensors: it reaches neither the engine, the store, the connector nor the loading I/O."""
    graph, _ = graph_and_lines()
    for package in (
        "blendkv.engine",
        "blendkv.store",
        "blendkv.connector",
        "blendkv.loading",
        "blendkv.rag",
    ):
        bad = reaching(graph, "blendkv.blend", package)
        assert not bad, f"blendkv.blend reaches {package}:\n" + "\n".join(bad)


def test_the_engine_reaches_no_connector_and_no_loading():
    """The engine knows connectors through ``KVConnectorBase`` only; the guards it runs
    (``blendkv.guards.audit``) are its own policies."""
    graph, _ = graph_and_lines()
    for package in ("blendkv.connector", "blendkv.loading", "blendkv.rag"):
        bad = reaching(graph, "blendkv.engine", package)
        assert not bad, f"the engine reaches {package}:\n" + "\n".join(bad)


def test_the_kv_store_knows_nothing_of_retrieval():
    """Chunking, embedding and the FAISS index (``blendkv.rag``) sit on top of the K/V store."""
    graph, _ = graph_and_lines()
    bad = reaching(graph, "blendkv.store", "blendkv.rag")
    assert not bad, "blendkv.store reaches blendkv.rag:\n" + "\n".join(bad)
