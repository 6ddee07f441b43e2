"""Evaluation examples and the loaders that read them from disk.

One in-memory shape for every dataset: an :class:`~blendkv.eval.examples.Example` (re-exported
here) is a question, its gold answers and the passages (documents) the engine will prefill as
separate chunks. Loaders never tokenise; the prompt pieces come from :mod:`blendkv.eval.prompts`.

Formats read here:

- CacheBlend JSON (``.json``): ``[{"question", "answers": [..] | str, "ctxs": [{"title",
  "text"}, ...]}, ...]``, optionally with ``"id"``/``"_id"`` per record.
- LongBench JSONL (``.jsonl``): one record per line, ``{"input": question, "context": str,
  "answers": [..] | str, "_id": ...}``; the context is split into passages by
  :func:`split_context`.

Malformed input raises :class:`DatasetError` naming the file and the record.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from blendkv.errors import BlendKVError
from blendkv.eval.cross_doc import cross_doc_examples
from blendkv.eval.examples import Example, Passage
from blendkv.eval.synthetic import make_synthetic

__all__ = [
    "DatasetError",
    "Example",
    "Passage",
    "dataset_kind",
    "load_cacheblend_json",
    "load_dataset",
    "load_longbench_jsonl",
    "split_context",
]

# Number of synthetic examples when ``load_dataset("synthetic")`` is given no limit.
DEFAULT_SYNTHETIC_EXAMPLES = 50


class DatasetError(BlendKVError, ValueError):
    """An evaluation data set is missing, of an unknown kind, or malformed."""


# ----------------------------------------------------------------------------- field checks


def _where(path: Path, index: int) -> str:
    return f"{path}: record {index}"


def _str_field(record: dict[str, Any], key: str, where: str, *, default: str | None = None) -> str:
    if key not in record:
        if default is not None:
            return default
        raise DatasetError(f"{where}: missing field {key!r}")
    value = record[key]
    if not isinstance(value, str):
        raise DatasetError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _answers(record: dict[str, Any], where: str) -> list[str]:
    """Gold answers as a list; a bare string (seen in some dumps) becomes a one-item list."""
    if "answers" not in record:
        raise DatasetError(f"{where}: missing field 'answers'")
    value = record["answers"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise DatasetError(f"{where}: 'answers' must be a string or a non-empty list of strings")
    return list(value)


def _record_id(record: dict[str, Any], path: Path, index: int) -> str:
    for key in ("id", "_id"):
        if isinstance(record.get(key), (str, int)):
            return str(record[key])
    return f"{path.stem}-{index}"


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise DatasetError(f"limit must be a non-negative int or None, got {limit!r}")


# ----------------------------------------------------------------------------- CacheBlend JSON


def load_cacheblend_json(path: str | Path, limit: int | None = None) -> list[Example]:
    """Read a CacheBlend-format JSON file (e.g. ``musique_dev.json``), in file order.

    ``limit`` keeps the first ``limit`` examples (all when None). Passage titles default to
    ``""`` when absent (MuSiQue's are empty strings anyway).
    """
    _check_limit(limit)
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such data file") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}") from e
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    if limit is not None:
        data = data[:limit]
    return [_cacheblend_example(record, path, i) for i, record in enumerate(data)]


def _cacheblend_example(record: Any, path: Path, index: int) -> Example:
    where = _where(path, index)
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected an object, got {type(record).__name__}")
    question = _str_field(record, "question", where)
    answers = _answers(record, where)
    ctxs = record.get("ctxs")
    if not isinstance(ctxs, list) or not ctxs:
        raise DatasetError(f"{where}: 'ctxs' must be a non-empty list of passages")
    passages = []
    for j, ctx in enumerate(ctxs):
        cwhere = f"{where}, ctxs[{j}]"
        if not isinstance(ctx, dict):
            raise DatasetError(f"{cwhere}: expected an object, got {type(ctx).__name__}")
        passages.append(
            Passage(
                title=_str_field(ctx, "title", cwhere, default=""),
                text=_str_field(ctx, "text", cwhere),
            )
        )
    if not question.strip():
        raise DatasetError(f"{where}: empty question")
    return Example(_record_id(record, path, index), question, answers, passages)


# ----------------------------------------------------------------------------- LongBench JSONL

# A line holding only "Passage 3:" (LongBench's multi-document QA sets join passages this way).
_PASSAGE_MARKER = re.compile(r"^[ \t]*Passage[ \t]+\d+[ \t]*:[ \t]*$", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n[ \t]*\n")


def split_context(context: str) -> list[Passage]:
    """Split a LongBench ``context`` string into passages.

    - When the context holds ``Passage N:`` marker lines, each marker starts a passage; text
      before the first marker (if any) is dropped when it is blank and kept as its own passage
      otherwise. Inside a passage of two or more lines, the first line is the title (LongBench
      writes ``Passage N:\\n<title>\\n<text>``); a one-line passage has an empty title.
    - Otherwise the context is split on blank lines, each paragraph an untitled passage.

    Whitespace around each passage is stripped; empty passages are dropped.
    """
    if _PASSAGE_MARKER.search(context):
        blocks = _PASSAGE_MARKER.split(context)
        passages = []
        for k, block in enumerate(blocks):
            block = block.strip()
            if not block:
                continue
            if k == 0:  # preamble before the first marker: keep it whole, untitled
                passages.append(Passage("", block))
                continue
            title, sep, text = block.partition("\n")
            passages.append(Passage(title.strip(), text.strip()) if sep else Passage("", block))
        return passages
    return [Passage("", p.strip()) for p in _BLANK_LINES.split(context) if p.strip()]


def load_longbench_jsonl(path: str | Path, limit: int | None = None) -> list[Example]:
    """Read a LongBench-style JSONL file, one example per non-blank line, in file order.

    Records are indexed from 0 over non-blank lines; errors also name the 1-based line.
    """
    _check_limit(limit)
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such data file") from None
    examples: list[Example] = []
    index = 0
    for lineno, line in enumerate(lines, start=1):
        if limit is not None and len(examples) >= limit:
            break
        if not line.strip():
            continue
        where = f"{_where(path, index)} (line {lineno})"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: invalid JSON at column {e.colno}") from e
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: expected an object, got {type(record).__name__}")
        question = _str_field(record, "input", where)
        answers = _answers(record, where)
        passages = split_context(_str_field(record, "context", where))
        if not question.strip():
            raise DatasetError(f"{where}: empty question ('input')")
        if not passages:
            raise DatasetError(f"{where}: empty 'context'")
        examples.append(Example(_record_id(record, path, index), question, answers, passages))
        index += 1
    return examples


# ----------------------------------------------------------------------------- dispatch


def dataset_kind(spec: str | Path) -> str:
    """The prompt family of a dataset spec: a key of ``blendkv.eval.prompts.DEFAULT_PROMPTS``.

    ``"synthetic"`` -> ``"synthetic"``; ``*.json`` (CacheBlend format) -> ``"musique"``;
    ``*.jsonl`` -> ``"longbench"``.
    """
    if str(spec) == "synthetic" or str(spec).startswith("synthetic:"):
        return "synthetic"
    suffix = Path(spec).suffix.lower()
    if suffix == ".json":
        return "musique"
    if suffix == ".jsonl":
        return "longbench"
    raise DatasetError(
        f"unknown dataset {str(spec)!r}: use 'synthetic', 'synthetic:cross_doc?seed=S&n=N&"
        "tokens=T[&chains=C]', a CacheBlend .json file or a LongBench .jsonl file"
    )


def load_dataset(
    spec: str | Path, limit: int | None = None, seed: int = 0, offset: int = 0
) -> list[Example]:
    """Load examples by spec: ``"synthetic"``, a ``.json`` or a ``.jsonl`` path.

    ``offset`` skips that many examples first (a slice of a data set: ``offset=40, limit=10``
    is examples 41-50, e.g. held out from tuning on the first 40); ``limit`` caps the number of
    examples after it (the synthetic generator makes exactly ``offset + limit``, or
    ``DEFAULT_SYNTHETIC_EXAMPLES`` when None). ``seed`` only drives the synthetic generator;
    files are returned in file order.
    """
    _check_limit(limit)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise DatasetError(f"offset must be a non-negative int, got {offset!r}")
    if offset:
        whole = load_dataset(spec, None if limit is None else offset + limit, seed)
        return whole[offset:]
    kind = dataset_kind(spec)
    if kind == "synthetic":
        if str(spec) != "synthetic":
            return _load_synthetic_task(str(spec), limit, seed)
        return make_synthetic(DEFAULT_SYNTHETIC_EXAMPLES if limit is None else limit, seed)
    if kind == "musique":
        return load_cacheblend_json(spec, limit)
    return load_longbench_jsonl(spec, limit)


# synthetic:TASK?key=value&...: a generated task and its parameters (integers).
_SYNTHETIC_TASKS = {"cross_doc": ("seed", "n", "tokens", "chains")}


def _load_synthetic_task(spec: str, limit: int | None, seed: int) -> list[Example]:
    """``synthetic:cross_doc?seed=7&n=50&tokens=6000``: the spec's ``seed`` and ``n`` win over
    ``--seed`` and the default count; ``limit`` caps ``n``."""
    task, _, query = spec.removeprefix("synthetic:").partition("?")
    if task not in _SYNTHETIC_TASKS:
        raise DatasetError(f"{spec!r}: unknown synthetic task {task!r}; known: cross_doc")
    params: dict[str, int] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in _SYNTHETIC_TASKS[task]:
            known = ", ".join(_SYNTHETIC_TASKS[task])
            raise DatasetError(f"{spec!r}: unknown parameter {key!r} (known: {known})")
        try:
            params[key] = int(value)
        except ValueError:
            raise DatasetError(f"{spec!r}: {key} must be an integer, got {value!r}") from None
    n = params.get("n", DEFAULT_SYNTHETIC_EXAMPLES)
    if limit is not None:
        n = min(n, limit)
    try:
        return cross_doc_examples(
            n, params.get("seed", seed), params.get("tokens", 6000), params.get("chains")
        )
    except ValueError as e:
        raise DatasetError(f"{spec!r}: {e}") from None
