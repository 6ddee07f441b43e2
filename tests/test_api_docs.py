"""The API reference (docs/api/*.md): every public name has a page, a docstring, and a docstring
that parses. The strict docs build (``make docs``) fails on the same faults; this checks them
without building the site, with the build's own options (mkdocs.yml) and griffe extension
(docs/hooks/api_reference.py)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import griffe  # the dev extra's mkdocstrings[python] brings it, mkdocs brings yaml
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# Where users import from: every name these export has a place in the reference.
PUBLIC_MODULES = ("blendkv", "blendkv.rag", "blendkv.store")
# Modules whose own public classes and functions are the API (no __all__).
PUBLIC_MODULES_WITHOUT_ALL = (
    "blendkv.integrations.langchain",
    "blendkv.integrations.llamaindex",
    "blendkv.integrations.llamaindex_llm",
    "blendkv.errors",
    "blendkv.rag.errors",
    "blendkv.store.errors",
)


def _hook():
    spec = importlib.util.spec_from_file_location(
        "api_reference", ROOT / "docs" / "hooks" / "api_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _python_options() -> dict:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            return plugin["mkdocstrings"]["handlers"]["python"]["options"]
    raise AssertionError("mkdocs.yml has no mkdocstrings plugin")


@pytest.fixture(scope="module")
def api():
    """(the hook module, griffe's collection of blendkv as the docs build loads it, the stale
    cross-references of each object)."""
    hook = _hook()
    options = _python_options()
    extension = hook.BlendKVPackage()
    extension.on_package = lambda **kwargs: None  # its checks are the tests below
    loader = griffe.GriffeLoader(
        extensions=griffe.load_extensions(extension),
        docstring_parser=griffe.Parser(options["docstring_style"]),
        docstring_options=options.get("docstring_options", {}),
    )
    package = loader.load("blendkv")
    loader.resolve_aliases(implicit=False, external=None)
    collection = loader.modules_collection
    # What the build's on_package does first: Sphinx roles to Markdown, stale ones noted.
    stale = {obj.path: hook.to_markdown(obj, collection) for obj in hook._walk(package)}
    return hook, collection, stale


def test_the_pages_name_objects_that_exist_and_have_docstrings(api):
    hook, collection, _ = api
    names = hook.documented_names()
    assert len(names) > 30
    missing = hook.missing_docstrings(collection, names)
    assert not missing, "public names on the API pages without a docstring: " + ", ".join(missing)


def test_every_docstring_on_the_pages_parses_without_warnings(api, caplog):
    hook, collection, _ = api
    caplog.set_level(logging.WARNING)
    for _, obj in hook.rendered(collection, hook.documented_names()):
        if isinstance(obj, griffe.Object) and obj.docstring is not None:
            obj.docstring.parse()
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not problems, "docstrings that do not render: " + "; ".join(problems)


def test_no_cross_reference_on_the_pages_names_a_missing_object(api):
    hook, collection, stale = api
    found = [
        f"{shown} -> {target}"
        for shown, obj in hook.rendered(collection, hook.documented_names())
        for target in stale.get(getattr(obj, "path", None), ())
    ]
    assert not found, found


def _canonical(collection, name: str) -> str | None:
    try:
        obj = collection.get_member(name)
    except KeyError:
        return None
    try:
        return obj.final_target.path if obj.is_alias else obj.path
    except griffe.AliasResolutionError:
        return None


def _public_api(collection) -> list[str]:
    """The public names, read from the source as griffe sees it (no framework imports)."""
    names = []
    for module_name in PUBLIC_MODULES:
        exports = collection.get_member(module_name).exports
        assert exports, f"{module_name} has no __all__"
        names += [f"{module_name}.{n}" for n in exports]
    for module_name in PUBLIC_MODULES_WITHOUT_ALL:
        module = collection.get_member(module_name)
        for name, member in module.members.items():
            if not name.startswith("_") and not member.is_alias:
                if member.is_class or member.is_function:
                    names.append(f"{module_name}.{name}")
    return names


def test_every_public_name_has_a_place_in_the_reference(api):
    """A name exported from blendkv, blendkv.rag or blendkv.store, or defined in an
    integration or errors module, is on an API page (itself, or as a member of a module
    page), under any of its import paths."""
    hook, collection, _ = api
    shown = set()
    for name, obj in hook.rendered(collection, hook.documented_names()):
        shown.add(name)
        if isinstance(obj, griffe.Object):
            shown.add(obj.path)
    for name in hook.documented_names():
        shown.add(_canonical(collection, name))
    public = _public_api(collection)
    absent = [n for n in public if n not in shown and _canonical(collection, n) not in shown]
    assert not absent, "public names missing from docs/api/*.md: " + ", ".join(absent)


def test_the_pages_are_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    text = yaml.safe_dump(config["nav"])
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        assert f"api/{page.name}" in text, page.name
