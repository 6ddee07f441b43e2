"""The API reference's checks, and griffe's view of the package (docs/api/*.md, mkdocs.yml).

mkdocstrings reads the source with griffe, which finds a package's submodules in its directory;
``blendkv.store`` lives in ``store/`` (pyproject's ``package-dir``), so :class:`BlendKVPackage`
mounts it under ``blendkv`` as Python imports it. It also fails the strict build when a public
name on an API page has no docstring (mkdocstrings would leave it out without a word):
``NO_MKDOCS_2_WARNING=1 mkdocs build --strict``; ``tests/test_api_docs.py`` runs the same
check without building the site.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import griffe

API_DIR = Path(__file__).resolve().parents[1] / "api"
_DIRECTIVE = re.compile(r"^::: *(\S+)", re.MULTILINE)
# Sphinx cross-reference roles, which the docstrings use: :class:`~blendkv.LLM`, :meth:`close`.
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`([^`]+)`")
_TITLED = re.compile(r"^(.*?)\s*<([^<>]+)>$")
_LITERAL = re.compile(r"(\S)::(\n[ \t]*\n)")
# blendkv's subpackages kept outside its directory (pyproject.toml: package-dir).
_MOUNTED = ("store",)
logger = griffe.get_logger("blendkv.api_reference")


def documented_names(api_dir: Path = API_DIR) -> list[str]:
    """The identifiers of the ``::: name`` directives on the API pages, in page order."""
    names = []
    for page in sorted(api_dir.glob("*.md")):
        names += _DIRECTIVE.findall(page.read_text(encoding="utf-8"))
    return names


def _target(obj: griffe.Object | griffe.Alias) -> griffe.Object | None:
    try:
        return obj.final_target if obj.is_alias else obj
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


# Members the pages leave out: private names, and pydantic's settings (mkdocs.yml's filters).
_HIDDEN = re.compile(r"^_|^model_config$")


def _public(name: str) -> bool:
    return not _HIDDEN.search(name)


_NAMED = (griffe.DocstringSectionKind.attributes, griffe.DocstringSectionKind.parameters)


def _named_in_docstring(cls: griffe.Object) -> set[str]:
    """The names a class's docstring, or its ``__init__``'s, documents in an ``Attributes:`` or
    ``Args:`` section (an attribute that keeps a constructor argument is documented there)."""
    names = set()
    init = cls.members.get("__init__") if cls.is_class else None
    for obj in (cls, init):
        if obj is None or obj.is_alias or obj.docstring is None:
            continue
        for section in obj.docstring.parsed:
            if section.kind in _NAMED:
                names.update(item.name.lstrip("*") for item in section.value)
    return names


def rendered(collection: griffe.ModulesCollection, names: list[str]) -> list[tuple[str, object]]:
    """What the API pages render for ``names``: ``(shown name, object)`` for each name and its
    public members (a module's own classes, functions and constants; a class's own methods,
    properties, attributes and nested classes). The object is None, or a string saying why,
    where a name does not resolve."""
    shown: list[tuple[str, object]] = []
    for name in names:
        try:
            obj = _target(collection.get_member(name))
        except KeyError:
            shown.append((name, "not found"))
            continue
        if obj is None:
            shown.append((name, "an import griffe cannot follow"))
            continue
        shown.append((name, obj))
        if obj.is_class or obj.is_module:
            for member_name, member in obj.members.items():
                if _public(member_name) and not member.is_alias and not member.is_module:
                    shown.append((f"{name}.{member_name}", member))
    return shown


def missing_docstrings(collection: griffe.ModulesCollection, names: list[str]) -> list[str]:
    """The public objects the API pages render, or would, that have no docstring.

    A class's public attributes count as documented when its docstring's ``Attributes:`` or
    ``Args:`` section names them (dataclass and pydantic fields, constructor arguments kept);
    a module's constants need none.
    """
    missing = []
    for shown, obj in rendered(collection, names):
        if not isinstance(obj, griffe.Object):
            missing.append(f"{shown} ({obj})")
        elif not obj.docstring or not obj.docstring.value.strip():
            owner = obj.parent
            if obj.is_attribute and owner is not None:
                if owner.is_module or obj.name in _named_in_docstring(owner):
                    continue
            missing.append(shown)
    return missing


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def _role_path(obj: griffe.Object, target: str) -> str | None:
    """The full path a role's target names from ``obj``'s scope; None when out of reach."""
    if target.startswith("blendkv."):
        return target
    head, _, rest = target.partition(".")
    try:
        path = obj.resolve(head)
    except griffe.NameResolutionError:
        return None
    return f"{path}.{rest}" if rest else path


def _exists(collection: griffe.ModulesCollection, path: str) -> bool:
    try:
        collection.get_member(path)
    except (KeyError, ValueError):
        owner_path, _, name = path.rpartition(".")  # a member a class inherits?
        try:
            owner = _target(collection.get_member(owner_path))
        except (KeyError, ValueError):
            return False
        return owner is not None and owner.is_class and name in owner.all_members
    return True


def to_markdown(obj: griffe.Object, collection: griffe.ModulesCollection) -> list[str]:
    """Rewrite the reStructuredText habits of ``obj``'s docstring as the Markdown mkdocstrings
    renders (the docstrings stay as the CLI and ``help()`` read them).

    A Sphinx role becomes inline code, linked when its target has an API page (autorefs'
    optional reference); a literal block's ``::`` becomes ``:`` (the indented block below is
    Markdown's code block as it is). Returns the ``blendkv.`` targets of roles that name
    nothing (a stale reference).
    """
    if obj.docstring is None:
        return []
    obj.docstring.value = _LITERAL.sub(r"\1:\2", obj.docstring.value)
    if ":`" not in obj.docstring.value:
        return []
    stale = []

    def replace(match: re.Match) -> str:
        text = match.group(1)
        titled = _TITLED.match(text)
        if titled:
            shown, target = titled.groups()
        else:
            target = text.lstrip("~!")
            shown = target.rsplit(".", 1)[-1] if text.startswith("~") else target
        target = target.lstrip("~!.")
        path = _role_path(obj, target)
        if path is None:
            return f"`{shown}`"
        if path.startswith("blendkv.") and not _exists(collection, path):
            stale.append(target)
            return f"`{shown}`"
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'

    obj.docstring.value = _ROLE.sub(replace, obj.docstring.value)
    return stale


class BlendKVPackage(griffe.Extension):
    """Mounts ``blendkv.store`` for griffe and checks the API pages' docstrings."""

    def __init__(self, api_dir: str | None = None) -> None:
        self.api_dir = Path(api_dir) if api_dir else API_DIR

    def on_module_members(self, *, node, mod: griffe.Module, agent, **kwargs) -> None:
        if mod.path != "blendkv" or not isinstance(agent, griffe.Visitor):
            return
        here = Path(mod.filepath).parent
        for sub in _MOUNTED:
            spec = importlib.util.find_spec(f"blendkv.{sub}")
            if spec is None or spec.origin is None:
                continue
            where = Path(spec.origin).parent
            if where != here / sub:  # griffe finds it there itself
                mod.set_member(sub, _visit_package(sub, where, mod, agent))

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.path != "blendkv":
            return
        collection = loader.modules_collection
        stale = {obj.path: to_markdown(obj, collection) for obj in _walk(pkg)}
        names = [n for n in documented_names(self.api_dir) if n.split(".")[0] == "blendkv"]
        for name in missing_docstrings(collection, names):
            logger.warning("API reference: %s has no docstring", name)
        for shown, obj in rendered(collection, names):
            for target in stale.get(getattr(obj, "path", None), ()):
                logger.warning("API reference: %s refers to %s, which is not there", shown, target)


def _visit_package(name: str, where: Path, parent: griffe.Module, agent) -> griffe.Module:
    """A flat package directory visited as ``parent.name`` (its modules' imports resolve)."""

    def visit(module_name: str, path: Path, under: griffe.Module) -> griffe.Module:
        code = path.read_text(encoding="utf-8-sig")
        agent.lines_collection[path] = code.splitlines(keepends=False)
        return griffe.visit(
            module_name,
            filepath=path,
            code=code,
            extensions=agent.extensions,
            parent=under,
            docstring_parser=agent.docstring_parser,
            docstring_options=agent.docstring_options,
            lines_collection=agent.lines_collection,
            modules_collection=agent.modules_collection,
        )

    package = visit(name, where / "__init__.py", parent)
    for path in sorted(where.glob("*.py")):
        if path.stem != "__init__":
            package.set_member(path.stem, visit(path.stem, path, package))
    return package
