"""Turning ingest inputs into validated documents, explicitly (a string that could be a path
or a text is refused, not guessed at).

    documents=  str (a text; one that looks like a path is refused), pathlib.Path (a file or a
                folder), a LangChain ``Document`` or a LlamaIndex node/``Document`` (duck-typed)
    paths=      files, folders and globs (``"docs/**/*.md"``), as str or Path
    texts=      strings that are texts, whatever they look like

A file's source is its path as given (``os.path.normpath``: ``./docs/a.md`` is ``docs/a.md``,
relative stays relative); a text's is None, or the ``"source"`` of its metadata (a title, a
URL). An unreadable file (empty, binary, not UTF-8, a PDF) inside a folder or a glob is skipped
and listed in :attr:`LoadedInputs.skipped` (``strict`` raises instead); a file named on its own
that cannot be read raises, and so does a folder or glob where nothing could be read.
Everything is read before anything is written.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blendkv.rag.errors import DocumentError, EmptyDocumentError, UnreadableDocumentError
from blendkv.text import replace_lone_surrogates

TEXT_SUFFIXES = (".txt", ".md")
_GLOB_CHARS = re.compile(r"[*?\[]")
# A bare word with a file-name suffix ("notes.md", "report.PDF"): a path, not a text.
_FILE_NAME = re.compile(r"^[\w.-]*\.[A-Za-z][A-Za-z0-9]{0,4}$")
_MAX_PATH = 4096


@dataclass(frozen=True)
class SourceDocument:
    """One document to ingest: its text, source (a path, a title, None) and own metadata."""

    text: str
    source: str | None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SkippedFile:
    """A file inside a folder or glob that could not be read (empty, binary, not UTF-8)."""

    path: str
    reason: str


@dataclass(frozen=True)
class LoadedInputs:
    """The documents an ingest will write, in input order, and the files it skipped.
    ``RAGPipeline.ingest`` accepts one as ``documents`` (the CLI reads before it loads a
    model, then ingests what it read)."""

    documents: tuple[SourceDocument, ...]
    skipped: tuple[SkippedFile, ...] = ()


def content_doc_id(text: str) -> str:
    """The default doc id: a hash of the text, so re-adding the same text is a no-op."""
    return "doc-" + hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def load_inputs(
    documents: Any = None,
    *,
    paths: Any = None,
    texts: Any = None,
    strict: bool = False,
) -> LoadedInputs:
    """Validated documents from ``documents``, then ``paths``, then ``texts`` (see the module
    docstring); raises :class:`DocumentError` subclasses, before anything is written."""
    if isinstance(documents, LoadedInputs):
        if paths is not None or texts is not None:
            raise DocumentError("give loaded documents alone, without paths= or texts=")
        return documents
    docs: list[SourceDocument] = []
    skipped: list[SkippedFile] = []
    for i, item in enumerate(_items(documents)):
        if isinstance(item, os.PathLike):
            _load_path(Path(item), docs, skipped, strict)
        elif isinstance(item, str):
            if looks_like_path(item):
                raise DocumentError(
                    f"document {i} is the string {item[:80]!r}, which names a path; pass "
                    f"Path({item[:80]!r}) or paths=[...] to ingest the file(s), or texts=[...] "
                    "if it is the text itself"
                )
            docs.append(SourceDocument(replace_lone_surrogates(item, f"document {i}"), None))
        else:
            docs.append(_framework_document(item, i))
    _read_files(input_files(paths), docs, skipped, strict)
    for i, item in enumerate(_items(texts)):
        if not isinstance(item, str):
            raise DocumentError(f"texts= takes str items, got a {type(item).__name__}")
        docs.append(SourceDocument(replace_lone_surrogates(item, f"text {i}"), None))
    if not docs:
        raise EmptyDocumentError("no documents given")
    for i, doc in enumerate(docs):
        if not doc.text.strip():
            raise EmptyDocumentError(f"document {doc.source or i} is empty")
    return LoadedInputs(tuple(docs), tuple(skipped))


def looks_like_path(text: str) -> bool:
    """Whether a string names an existing file or folder, or is one word shaped like a path
    or a glob (a separator, a glob character, a file-name suffix)."""
    if not text or len(text) > _MAX_PATH or "\n" in text:
        return False
    try:
        if os.path.exists(text):
            return True
    except (OSError, ValueError):  # e.g. a NUL byte, a name too long for the file system
        pass
    if any(c.isspace() for c in text):
        return False
    has_separator = "/" in text or "\\" in text
    return has_separator or bool(_GLOB_CHARS.search(text) or _FILE_NAME.match(text))


def _items(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)) or _is_framework_document(value):
        return [value]
    if not isinstance(value, Iterable) or isinstance(value, (dict, bytes, bytearray)):
        raise DocumentError(f"a {type(value).__name__} is not a document or a list of them")
    return list(value)


def _is_framework_document(item: Any) -> bool:
    return hasattr(item, "page_content") or callable(getattr(item, "get_content", None))


def _framework_document(item: Any, i: int) -> SourceDocument:
    """A LangChain ``Document`` (``page_content``) or a LlamaIndex node (``get_content()``),
    duck-typed; its metadata's ``source`` (LlamaIndex: ``file_path``) becomes the source."""
    if hasattr(item, "page_content"):
        text = item.page_content
    elif callable(getattr(item, "get_content", None)):
        text = item.get_content()  # LlamaIndex's default mode: the text without its metadata
    else:
        raise UnreadableDocumentError(
            f"document {i} is a {type(item).__name__}; give a str (text), a Path, a LangChain "
            "Document or a LlamaIndex node"
        )
    if not isinstance(text, str):
        raise DocumentError(f"document {i} ({type(item).__name__}) has no text")
    metadata = getattr(item, "metadata", None) or {}
    if not isinstance(metadata, dict):
        raise DocumentError(f"document {i} ({type(item).__name__}) has non-dict metadata")
    metadata = dict(metadata)
    source = metadata.pop("source", None)
    if source is None:
        source = metadata.get("file_path")
    text = replace_lone_surrogates(text, f"document {i}")
    return SourceDocument(text, None if source is None else str(source), metadata)


@dataclass(frozen=True)
class InputFile:
    """A file an ingest will read: its path and the folder or glob it was found in (None: it
    was named on its own, so that failing to read it is an error, not a skip)."""

    path: Path
    where: str | None = None


def input_files(paths: Any) -> list[InputFile]:
    """The files ``paths`` (files, folders, globs) name, in ingest order, none read yet;
    raises for a path that does not exist, a pattern that matches no file and a folder
    without text files. :func:`read_input_file` reads one (a distributed ingest reads them
    on its workers)."""
    out: list[InputFile] = []
    for item in _items(paths):
        if not isinstance(item, (str, os.PathLike)):
            raise DocumentError(f"paths= takes str or Path items, got a {type(item).__name__}")
        out.extend(_path_or_glob_files(item))
    return out


def read_input_file(f: InputFile, strict: bool = False) -> SourceDocument | SkippedFile:
    """``f`` read: its document, or, for a file of a folder or glob that cannot be read (empty,
    binary, not UTF-8), why it is skipped; raises instead for a file named on its own, or
    with ``strict``."""
    if f.where is None:
        return SourceDocument(read_text_file(f.path), _source(f.path))
    try:
        text = read_text_file(f.path)
    except (UnreadableDocumentError, OSError) as e:
        if strict:
            raise UnreadableDocumentError(f"{e} (--strict / strict=True)") from e
        return SkippedFile(_source(f.path), _reason(e, f.path))
    if not text.strip():
        if strict:
            raise EmptyDocumentError(f"{f.path} is empty (--strict / strict=True)")
        return SkippedFile(_source(f.path), "empty")
    return SourceDocument(text, _source(f.path))


def check_folders_read(files: list[InputFile], read: list[SourceDocument | SkippedFile]) -> None:
    """Raise when a folder or glob had files and none of them could be read."""
    found: dict[str, list[SkippedFile]] = {}
    ok: set[str] = set()
    for f, got in zip(files, read, strict=True):
        if f.where is None:
            continue
        found.setdefault(f.where, [])
        if isinstance(got, SkippedFile):
            found[f.where].append(got)
        else:
            ok.add(f.where)
    for where, skipped in found.items():
        if where not in ok:
            raise UnreadableDocumentError(
                f"{where}: none of its {len(skipped)} file(s) could be read "
                f"({'; '.join(f'{s.path}: {s.reason}' for s in skipped[-3:])})"
            )


def _load_path(path: Path, docs, skipped, strict: bool) -> None:
    """A file or folder given as a ``Path`` in ``documents=`` (never a glob)."""
    _read_files(_path_files(path), docs, skipped, strict)


def _read_files(files: list[InputFile], docs, skipped, strict: bool) -> None:
    read = [read_input_file(f, strict) for f in files]
    check_folders_read(files, read)
    for got in read:
        (skipped if isinstance(got, SkippedFile) else docs).append(got)


def _path_or_glob_files(item) -> list[InputFile]:
    name = os.fspath(item)
    if isinstance(name, bytes):
        raise DocumentError(f"paths= takes str or Path items, got the bytes path {name!r}")
    if Path(name).exists() or not _GLOB_CHARS.search(name):
        return _path_files(Path(name))
    found = sorted(Path(p) for p in glob.glob(name, recursive=True))
    files = [p for p in found if p.is_file()]  # glob's "*" skips hidden names itself
    if not files:
        raise UnreadableDocumentError(f"{name}: the pattern matches no file")
    return [InputFile(f, name) for f in files]


def _path_files(path: Path) -> list[InputFile]:
    if path.is_dir():
        files = sorted(
            f
            for f in path.rglob("*")
            if f.is_file() and f.suffix in TEXT_SUFFIXES and not _hidden(f, path)
        )
        if not files:
            pdfs = [f for f in path.rglob("*.pdf") if f.is_file() and not _hidden(f, path)]
            advice = f" (it holds {len(pdfs)} PDF file(s): {pdf_advice(pdfs[0])})" if pdfs else ""
            raise EmptyDocumentError(f"{path} holds no {'/'.join(TEXT_SUFFIXES)} files{advice}")
        return [InputFile(f, str(path)) for f in files]
    if path.is_file():
        return [InputFile(path)]
    raise UnreadableDocumentError(f"{path}: no such file or directory")


def pdf_advice(path: Path | str) -> str:
    """What to do with a PDF: ingest reads plain text only."""
    txt = Path(path).with_suffix(".txt").name
    return (
        "blendkv ingests plain text: extract the PDF's text first (e.g. "
        f"`pdftotext {Path(path).name} {txt}`, from poppler-utils) and ingest the .txt, or load "
        "it with a LangChain or LlamaIndex PDF loader and pass the Documents to ingest"
    )


def read_text_file(path: Path) -> str:
    data = path.read_bytes()
    if b"%PDF-" in data[:1024]:  # the PDF header (readers allow junk before it)
        raise UnreadableDocumentError(f"{path}: a PDF, not text; {pdf_advice(path)}")
    if b"\x00" in data[:8192]:
        raise UnreadableDocumentError(
            f"{path}: binary (NUL bytes), not .txt/.md text; convert it to plain text first"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableDocumentError(
            f"{path}: not UTF-8 text (byte {e.start}); convert it to UTF-8 first"
        ) from e


def _source(path: Path) -> str:
    return os.path.normpath(path)


def _hidden(path: Path, root: Path) -> bool:
    """A file under a hidden folder (``.git``, ``.venv``) or hidden itself, below ``root``."""
    parts = path.relative_to(root).parts
    return any(p.startswith(".") and p not in (".", "..") for p in parts)


def _reason(error: Exception, path: Path) -> str:
    text = str(error)
    prefix = f"{path}: "
    return text[len(prefix) :] if text.startswith(prefix) else text
