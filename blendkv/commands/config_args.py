"""Command-line flags generated from config dataclasses, so no command declares them by hand.

``add_config_args(parser, EngineConfig, ["dtype", "block_size"])`` adds ``--dtype`` and
``--block-size``: the type comes from the field's annotation (``bool`` -> ``--x/--no-x``,
``int``, ``float``, ``str``, each optionally ``| None``), the choices from the field's
``metadata["choices"]``, the default from the dataclass (or ``defaults``), and the help text
from the class docstring's Google-style ``Attributes:`` section. ``config_kwargs`` reads the
values back as keyword arguments for the config (or for ``LLM``, which routes them).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_ENTRY = re.compile(r"^(\w+(?:\s*/\s*\w+)*)\s*:\s*(.*)$")


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> its text in ``cls``'s docstring ``Attributes:`` section, on one line.

    An entry is ``name: text`` (or ``a / b: text`` for two fields sharing it), indented under
    the section; deeper-indented lines continue it. A line at the section's indent or less ends
    the section.
    """
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    section_indent = _indent(lines[start])
    docs: dict[str, list[str]] = {}
    entry_indent = None
    current: list[str] = []
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = _indent(line)
        if indent <= section_indent:
            break
        if entry_indent is None:
            entry_indent = indent
        match = _ENTRY.match(line.strip()) if indent == entry_indent else None
        if match:
            current = [match.group(2)]
            for name in re.split(r"\s*/\s*", match.group(1)):
                docs[name] = current
        else:
            current.append(line.strip())
    return {name: " ".join(parts).strip() for name, parts in docs.items()}


def add_config_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type | Sequence[type],
    names: Iterable[str],
    *,
    aliases: Mapping[str, Sequence[str]] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add ``--field-name`` for each of ``names`` (fields of the dataclass ``cls``, or of the
    first of several classes that has it: a config and its nested configs).

    ``aliases`` maps a field to more flag names for it (older spellings keep working; a bool's
    ``--no-`` form comes with each); ``defaults`` overrides the dataclass's default.
    """
    classes = list(cls) if isinstance(cls, Sequence) else [cls]
    owner: dict[str, type] = {}
    for c in reversed(classes):
        owner.update({f.name: c for f in dataclasses.fields(c)})
    aliases = aliases or {}
    defaults = defaults or {}
    for name in names:
        if name not in owner:
            raise ValueError(f"{' / '.join(c.__name__ for c in classes)} has no field {name!r}")
        c = owner[name]
        field = {f.name: f for f in dataclasses.fields(c)}[name]
        hints, docs = typing.get_type_hints(c), attribute_docs(c)
        base = _base_type(hints[name], f"{c.__name__}.{name}")
        optional = _is_optional(hints[name])
        flags = [f"--{name.replace('_', '-')}", *aliases.get(name, ())]
        default = defaults.get(name, field.default)
        help_ = docs.get(name, "").replace("%", "%%") or None
        kwargs: dict[str, Any] = {"dest": name, "default": default, "help": help_}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _or_none(base) if optional and base in (int, float) else base
            choices = field.metadata.get("choices")
            if choices is not None:
                kwargs["choices"] = list(choices)
        action = parser.add_argument(*flags, **kwargs)
        if help_ is not None and default is not None and "%(default)" not in action.help:
            # (Some Python versions' BooleanOptionalAction adds this itself.)
            action.help = f"{help_.rstrip('.')} (default: %(default)s)"


def config_kwargs(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The parsed values of the fields ``names``, as keyword arguments for the config."""
    return {name: getattr(args, name) for name in names}


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(hint)
    )


def _or_none(base: type):
    """``base``, or None for ``none`` (a number field that may be unset: ``--x none``)."""

    def parse(text: str):
        return None if text.strip().lower() == "none" else base(text)

    parse.__name__ = base.__name__  # argparse names the type in its errors
    return parse


def _base_type(hint: Any, where: str) -> type:
    """``bool``, ``int``, ``float`` or ``str`` from a hint that may add ``| None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    if hint not in (bool, int, float, str):
        raise TypeError(f"{where}: no command-line flag for a field of type {hint!r}")
    return hint


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
