"""User text at the entry points: lone UTF-16 surrogates are replaced, not fatal.

A ``str`` may hold surrogates (U+D800..U+DFFF: PDF text, broken JSON escapes, ``os.fsdecode``),
which have no UTF-8 encoding, so a tokenizer would raise. Every entry point passes user text
through :func:`replace_lone_surrogates`, with ``bytes.decode(errors="replace")`` semantics: a
high+low pair is joined (``"\\ud83d\\ude00"`` -> ``"😀"``), any other surrogate becomes U+FFFD
with a warning on the ``blendkv.text`` logger; the request is then served.
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

_SURROGATE = re.compile("[\ud800-\udfff]")
# A surrogate that is not half of a (high, low) pair.
_LONE = re.compile("[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]")
_MAX_LISTED = 5


def replace_lone_surrogates(text: str, where: str) -> str:
    """``text`` with surrogate pairs joined and lone surrogates replaced by U+FFFD.

    ``where`` names the text in the warning (e.g. ``"document 3"``, ``"prompt"``). Text
    without surrogates is returned as is (one regex search).
    """
    if _SURROGATE.search(text) is None:
        return text
    lone = [m.start() for m in _LONE.finditer(text)]
    if lone:
        listed = ", ".join(str(i) for i in lone[:_MAX_LISTED])
        more = f" (and {len(lone) - _MAX_LISTED} more)" if len(lone) > _MAX_LISTED else ""
        logger.warning(
            "%s: lone surrogate(s) at character offset(s) %s%s replaced with U+FFFD; "
            "the text was not valid Unicode (common in text extracted from PDFs)",
            where,
            listed,
            more,
        )
    # UTF-16 with surrogatepass turns every code point into its 16-bit units; decoding them
    # back joins the valid pairs and replaces each unpaired unit with U+FFFD.
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def replace_in_blended_prompt(prompt: dict[str, Any]) -> dict[str, Any]:
    """A copy of a blended prompt dict whose texts (``documents[i]``, ``query``, ``system``,
    ``instruction``) went through :func:`replace_lone_surrogates`; values of other types are
    left to the prompt's own validation."""
    out = dict(prompt)
    docs = prompt.get("documents")
    if isinstance(docs, (list, tuple)):
        out["documents"] = [
            replace_lone_surrogates(d, f"blended prompt documents[{i}]")
            if isinstance(d, str)
            else d
            for i, d in enumerate(docs)
        ]
    for key in ("query", "system", "instruction"):
        if isinstance(prompt.get(key), str):
            out[key] = replace_lone_surrogates(prompt[key], f"blended prompt {key}")
    return out
