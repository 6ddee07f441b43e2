"""Ingest inputs, model-free (``blendkv.rag.documents.load_inputs``): a string that names a path
is refused, not stored as a two-token document; paths, globs, texts, LangChain documents and
LlamaIndex nodes are each taken explicitly; an unreadable file inside a folder is skipped
(``strict`` raises), one named on its own raises, and so does a folder where nothing reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blendkv.errors import BlendKVError
from blendkv.rag.documents import LoadedInputs, load_inputs, looks_like_path
from blendkv.rag.errors import DocumentError, EmptyDocumentError, UnreadableDocumentError


@pytest.fixture
def docs(tmp_path, monkeypatch) -> Path:
    """docs/{a.md, b.txt, sub/c.md, notes.rst, .hidden/h.md}, with the cwd at tmp_path."""
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "a.md").write_text("Alpha text about okapis.")
    (root / "b.txt").write_text("Bravo text about falcons.")
    (root / "sub" / "c.md").write_text("Charlie text about walruses.")
    (root / "notes.rst").write_text("Not a .txt/.md file.")
    (root / ".hidden" / "h.md").write_text("Hidden folders are not ingested.")
    return Path("docs")


def test_a_string_naming_a_path_is_refused(docs):
    for text in ("docs", "docs/a.md", "../docs", "docs/**/*.md", "report.pdf", "./notes.md"):
        with pytest.raises(DocumentError, match=r"names a path; pass Path\(") as info:
            load_inputs([text])
        assert isinstance(info.value, BlendKVError)
    # Said to be texts, they are texts; sentences and words are texts without saying so.
    assert [d.text for d in load_inputs(texts=["../docs"]).documents] == ["../docs"]
    for text in ("The okapi lives in the Congo.", "hello", "e.g.", "3.14", "a file.md here"):
        assert not looks_like_path(text), text
        [doc] = load_inputs(text).documents
        assert (doc.text, doc.source) == (text, None)


def test_path_and_folder_and_glob(docs):
    [a] = load_inputs(docs / "a.md").documents
    assert (a.text, a.source) == ("Alpha text about okapis.", os.path.join("docs", "a.md"))
    folder = load_inputs([Path("./docs")]).documents  # .txt/.md, recursive, hidden folders not
    assert [d.source for d in folder] == [
        os.path.join("docs", "a.md"),
        os.path.join("docs", "b.txt"),
        os.path.join("docs", "sub", "c.md"),
    ]
    assert load_inputs(paths=["docs"]).documents == folder  # str paths: explicit
    globbed = load_inputs(paths=["docs/**/*.md"]).documents
    assert [d.source for d in globbed] == [
        os.path.join("docs", "a.md"),
        os.path.join("docs", "sub", "c.md"),
    ]
    # A glob may name any suffix; a named file of any suffix is read as text.
    assert [d.text for d in load_inputs(paths="docs/*.rst").documents] == ["Not a .txt/.md file."]
    with pytest.raises(UnreadableDocumentError, match="matches no file"):
        load_inputs(paths=["docs/*.pdf"])
    with pytest.raises(UnreadableDocumentError, match="no such file"):
        load_inputs(paths=["docs/missing.md"])
    mixed = load_inputs([Path("docs/a.md")], paths=["docs/b.txt"], texts=["A text."]).documents
    assert [d.source for d in mixed] == [
        os.path.join("docs", "a.md"),
        os.path.join("docs", "b.txt"),
        None,
    ]


def test_unreadable_files_in_a_folder_are_skipped_unless_strict(docs):
    (docs / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (docs / "empty.md").write_text(" \n")
    (docs / "image.md").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    loaded = load_inputs([docs])
    assert len(loaded.documents) == 3
    reasons = {Path(s.path).name: s.reason for s in loaded.skipped}
    assert reasons.keys() == {"latin1.txt", "empty.md", "image.md"}
    assert reasons["empty.md"] == "empty" and "not UTF-8" in reasons["latin1.txt"]
    assert "binary" in reasons["image.md"]
    globbed = load_inputs(paths=["docs/*.md"])  # a glob skips the same way
    assert {Path(s.path).name for s in globbed.skipped} == {"empty.md", "image.md"}
    with pytest.raises(EmptyDocumentError, match="strict"):  # empty.md, first in order
        load_inputs([docs], strict=True)
    (docs / "empty.md").unlink()
    with pytest.raises(UnreadableDocumentError, match="binary.*strict"):  # then image.md
        load_inputs([docs], strict=True)
    # A file named on its own that cannot be read is an error, skipping or not.
    with pytest.raises(UnreadableDocumentError, match="binary"):
        load_inputs([docs / "image.md"])
    with pytest.raises(UnreadableDocumentError, match="binary"):
        load_inputs(paths=["docs/image.md"])


def test_a_folder_where_nothing_reads_is_an_error(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.txt").write_bytes(b"\xff\xfe latin")
    (bad / "y.md").write_text("")
    with pytest.raises(UnreadableDocumentError, match="none of its 2 file"):
        load_inputs([bad])
    only_images = tmp_path / "images"
    only_images.mkdir()
    (only_images / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(EmptyDocumentError, match="holds no .txt/.md files"):
        load_inputs([only_images])


def test_a_pdf_is_refused_with_what_to_do(docs):
    """A PDF is not text: named alone, matched by a glob or the only kind in a folder, the error
    says to extract its text first (and how), not that it is binary or not UTF-8."""
    pdf = b"%PDF-1.4\n%\xac\xdc \xab\xba\n1 0 obj\n<< /Type /Catalog >>\nendobj\n"
    (docs / "paper.pdf").write_bytes(pdf)  # no NUL byte and not UTF-8, like many PDFs
    (docs / "scan.pdf").write_bytes(pdf + b"\x00stream\x00")
    for name in ("paper.pdf", "scan.pdf"):
        with pytest.raises(UnreadableDocumentError, match=f"a PDF, not text.*pdftotext {name}"):
            load_inputs([docs / name])
    with pytest.raises(UnreadableDocumentError, match="none of its 2 file.*a PDF.*pdftotext"):
        load_inputs(paths=["docs/*.pdf"])
    pdfs = Path("pdfs")
    pdfs.mkdir()
    (pdfs / "paper.pdf").write_bytes(pdf)
    with pytest.raises(EmptyDocumentError, match="no .txt/.md files.*1 PDF file.*pdftotext"):
        load_inputs([pdfs])


def test_langchain_documents_and_llamaindex_nodes():
    from langchain_core.documents import Document
    from llama_index.core.schema import Document as LlamaDocument
    from llama_index.core.schema import TextNode

    loaded = load_inputs(
        [
            Document(page_content="From LangChain.", metadata={"source": "web/a.html", "n": 1}),
            Document(page_content="No source here."),
            TextNode(text="A LlamaIndex node.", metadata={"file_path": "docs/n.md", "k": "v"}),
            LlamaDocument(text="A LlamaIndex document.", metadata={"source": "title"}),
        ]
    )
    got = [(d.text, d.source, d.metadata) for d in loaded.documents]
    assert got == [
        ("From LangChain.", "web/a.html", {"n": 1}),  # "source" becomes the source
        ("No source here.", None, {}),
        ("A LlamaIndex node.", "docs/n.md", {"file_path": "docs/n.md", "k": "v"}),
        ("A LlamaIndex document.", "title", {}),  # its text only, not its metadata
    ]


def test_bad_inputs_are_typed_errors(docs):
    for bad, error in (
        ([42], UnreadableDocumentError),
        (42, DocumentError),
        ({"text": "a dict is not a document"}, DocumentError),
        (b"bytes are not text", DocumentError),
        ([], EmptyDocumentError),
        ([""], EmptyDocumentError),
    ):
        with pytest.raises(error):
            load_inputs(bad)
    with pytest.raises(DocumentError, match="texts= takes str"):
        load_inputs(texts=[Path("docs/a.md")])
    with pytest.raises(DocumentError, match="paths= takes str or Path"):
        load_inputs(paths=[42])
    loaded = load_inputs(paths=["docs"])
    assert load_inputs(loaded) is loaded and isinstance(loaded, LoadedInputs)
    with pytest.raises(DocumentError, match="alone"):
        load_inputs(loaded, texts=["x"])
