"""Command-line flags generated from config dataclasses (``blendkv.commands.config_args``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

import pytest

from blendkv.commands.config_args import add_config_args, attribute_docs, config_kwargs


@dataclass(frozen=True)
class Toy:
    """A config for the test.

    Attributes:
        use_cache: keep results; the help
            goes on over two lines (100% of them).
        prefetch: None picks.
        rows: rows per pass.
        limit: a byte limit or None.
        ratio: a fraction.
        mode: how to run.
        low / high: the two bounds.
        kind: a field no flag can be made for.

    Sections after the attributes are not attributes:
        other: not a field.
    """

    use_cache: bool = True
    prefetch: bool | None = None
    rows: int = 16
    limit: int | None = None
    ratio: float = 0.5
    mode: str = field(default="auto", metadata={"choices": ("auto", "fast", "exact")})
    low: int = 0
    high: int = 9
    kind: object = None


ALL = ("use_cache", "prefetch", "rows", "limit", "ratio", "mode")


def parser(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    add_config_args(p, Toy, ALL, **kwargs)
    return p


def test_types_defaults_and_values_come_from_the_dataclass():
    defaults = config_kwargs(parser().parse_args([]), ALL)
    assert defaults == {
        "use_cache": True,
        "prefetch": None,
        "rows": 16,
        "limit": None,
        "ratio": 0.5,
        "mode": "auto",
    }
    args = parser().parse_args(
        ["--no-use-cache", "--prefetch", "--rows", "4", "--limit", "7", "--ratio", "0.25"]
        + ["--mode", "exact"]
    )
    kwargs = config_kwargs(args, ALL)
    assert kwargs == {
        "use_cache": False,
        "prefetch": True,
        "rows": 4,
        "limit": 7,
        "ratio": 0.25,
        "mode": "exact",
    }
    Toy(**kwargs)
    assert config_kwargs(parser().parse_args(["--no-prefetch"]), ["prefetch"]) == {
        "prefetch": False
    }


@pytest.mark.parametrize("argv", [["--mode", "slow"], ["--rows", "x"], ["--ratio", "half"]])
def test_bad_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(argv)
    assert "invalid" in capsys.readouterr().err


def test_help_comes_from_the_docstring():
    docs = attribute_docs(Toy)
    assert docs["use_cache"] == "keep results; the help goes on over two lines (100% of them)."
    assert docs["low"] == docs["high"] == "the two bounds."
    assert "other" not in docs
    text = parser().format_help()
    assert "keep results; the help goes on over two lines (100% of them)" in " ".join(text.split())
    assert "rows per pass (default: 16)" in text
    assert "{auto,fast,exact}" in text


def test_aliases_and_overridden_defaults():
    p = parser(aliases={"use_cache": ("--cache",), "rows": ("-n",)}, defaults={"rows": 8})
    assert p.parse_args(["--no-cache"]).use_cache is False
    assert p.parse_args(["--cache"]).use_cache is True
    assert p.parse_args(["--no-use-cache"]).use_cache is False
    assert p.parse_args(["-n", "3"]).rows == 3
    assert p.parse_args([]).rows == 8


def test_fields_without_a_flag_type_or_unknown_names_are_refused():
    with pytest.raises(TypeError, match="Toy.kind"):
        add_config_args(argparse.ArgumentParser(), Toy, ["kind"])
    with pytest.raises(ValueError, match="no field 'nope'"):
        add_config_args(argparse.ArgumentParser(), Toy, ["nope"])


def test_every_documented_config_field_has_help():
    """EngineConfig's and BlendConnectorConfig's docstrings document every field."""
    from blendkv.config import EngineConfig
    from blendkv.connector.config import BlendConnectorConfig

    for cls in (EngineConfig, BlendConnectorConfig):
        docs = attribute_docs(cls)
        assert set(docs) == {f.name for f in fields(cls)}, cls.__name__
        assert all(docs.values()), cls.__name__
