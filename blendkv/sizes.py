"""Byte sizes for people: ``"20G"`` in (flags, ``store_max_bytes=``), ``"2.3 GiB"`` out.

Kept free of torch and of the store, so that the command line parses size flags without
loading either.
"""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from a human size: ``"20G"``, ``"500M"``, ``"1.5GiB"``, ``"4096"`` (binary
    units: K = 1024). Raises ``ValueError`` on anything else or on zero."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        if match is None:
            raise ValueError(f"not a size: {text!r} (e.g. 500M, 20G, 4096)")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def format_size(n: int | float) -> str:
    """``n`` bytes for a person: ``"2.3 GiB"``, ``"512 B"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def size_arg(text: str) -> int:
    """argparse ``type=`` of a size flag."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
