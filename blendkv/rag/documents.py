"""Turning user input (strings, files, folders) into validated document texts.

Everything is read and checked before anything is written, so one bad file fails the whole
batch and leaves the store untouched.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from blendkv.rag.errors import EmptyDocumentError, UnreadableDocumentError
from blendkv.text import replace_lone_surrogates

TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class SourceDocument:
    text: str
    source: str | None  # the file it came from, None for a string


def content_doc_id(text: str) -> str:
    """The default doc id: a hash of the text, so re-adding the same text is a no-op."""
    return "doc-" + hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def expand_paths(paths: list[str | os.PathLike]) -> list[Path]:
    """Files as given, folders expanded (recursively, sorted) to their .txt/.md files."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not found:
                raise EmptyDocumentError(f"{p} holds no {'/'.join(TEXT_SUFFIXES)} files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise UnreadableDocumentError(f"{p}: no such file or directory")
    return out


def read_text_file(path: Path) -> str:
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise UnreadableDocumentError(f"{path} looks binary (NUL bytes); give .txt/.md text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableDocumentError(
            f"{path} is not UTF-8 text (byte {e.start}); convert it to UTF-8 first"
        ) from e


def load_documents(items) -> list[SourceDocument]:
    """Validated documents. A ``str`` is a document's text; a ``pathlib.Path`` (any
    ``os.PathLike``) is a file or a folder of .txt/.md files."""
    if isinstance(items, (str, os.PathLike)):
        items = [items]
    docs: list[SourceDocument] = []
    for i, item in enumerate(items):
        if isinstance(item, os.PathLike):
            docs.extend(SourceDocument(read_text_file(p), str(p)) for p in expand_paths([item]))
        elif isinstance(item, str):
            docs.append(SourceDocument(replace_lone_surrogates(item, f"document {i}"), None))
        else:
            raise UnreadableDocumentError(
                f"document {i} is a {type(item).__name__}; give a str (text) or a Path"
            )
    if not docs:
        raise EmptyDocumentError("no documents given")
    for i, doc in enumerate(docs):
        if not doc.text.strip():
            raise EmptyDocumentError(f"document {doc.source or i} is empty")
    return docs
