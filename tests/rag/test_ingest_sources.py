"""Ingest by source, on the tiny model and the real store: a path and the same text are the
same document (the file's text, never its name); an edited file replaces its old version once
the new one is stored, computing only its changed chunks and keeping the chunks another
document shares; unreadable files of a folder are skipped and counted (CLI too)."""

from __future__ import annotations

import random

import pytest
from helpers import QUIET_FLAGS

from blendkv.cli import main
from blendkv.rag.errors import DocumentError

pytestmark = pytest.mark.slow

WORDS = (
    "okapi glacier lighthouse volcano beetle river hill forest harbour meadow lantern copper "
    "violin saffron tundra compass orchard falcon marble quartz walrus cedar ember prairie"
).split()


def prose(seed: int, num_words: int) -> str:
    """Distinct random sentences (no two chunks equal)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(num_words)]
    return " ".join(w + ("." if i % 9 == 8 else "") for i, w in enumerate(words))


class ComputedRows:
    """Counts the chunks the pipeline computes K/V for (the runner's ``compute_chunk_kv``)."""

    def __init__(self, rag, monkeypatch) -> None:
        self.rows = 0
        runner = rag.llm.engine.runner
        real = runner.compute_chunk_kv

        def counted(contexts, chunks):
            self.rows += len(chunks)
            return real(contexts, chunks)

        monkeypatch.setattr(runner, "compute_chunk_kv", counted)


def test_a_path_and_its_text_are_one_document(tiny_rag, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = prose(1, 60)
    (tmp_path / "notes.md").write_text(text)
    with pytest.raises(DocumentError, match="names a path"):
        tiny_rag.ingest("notes.md", progress=False)  # once, the file name was the document
    by_path = tiny_rag.ingest(paths=["notes.md"], progress=False)
    assert by_path.sources == ("notes.md",) and by_path.num_chunks > 1
    by_text = tiny_rag.ingest(texts=[text], progress=False)
    assert by_text.doc_ids == by_path.doc_ids and by_text.skipped == by_path.doc_ids
    [doc_id] = by_path.doc_ids
    entry = tiny_rag.documents()[doc_id]
    assert entry["source"] == "notes.md"
    stored = tiny_rag.store.kv.document_chunks(doc_id)
    assert "".join(m.text for m in stored) == text
    titled = tiny_rag.ingest(texts=[prose(2, 20)], metadata={"source": "A title", "k": 1})
    assert titled.sources == ("A title",)
    assert tiny_rag.documents()[titled.doc_ids[0]]["metadata"] == {"k": 1}


def test_an_edited_file_replaces_its_old_version(tiny_rag, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shared, first, edit = prose(10, 90), prose(11, 90), prose(12, 40)
    (tmp_path / "other.md").write_text(shared + " " + prose(13, 40))
    (tmp_path / "notes.md").write_text(shared + " " + first)
    # notes.md first: it owns the chunks both files start with, which replacing it must hand
    # over to other.md.
    v1 = tiny_rag.ingest(paths=["notes.md"], progress=False)
    other = tiny_rag.ingest(paths=["other.md"], progress=False)
    [old] = v1.doc_ids
    assert other.reused_chunks > 0  # their common start is stored once, owned by notes.md
    total_v1 = tiny_rag.documents()[old]["num_chunks"]

    (tmp_path / "notes.md").write_text(shared + " " + first + " " + edit)
    rows = ComputedRows(tiny_rag, monkeypatch)
    v2 = tiny_rag.ingest(paths=["notes.md"], progress=False)
    [new] = v2.doc_ids
    assert new != old and v2.added == (new,) and v2.replaced == ((old, new),)
    # Only the changed tail is computed; the unchanged chunks are reused from the store.
    assert rows.rows == v2.num_chunks and 0 < v2.num_chunks < total_v1
    assert v2.reused_chunks == tiny_rag.documents()[new]["num_chunks"] - v2.num_chunks
    assert old not in tiny_rag.documents() and not tiny_rag.store.kv.document_chunks(old)
    assert tiny_rag.verify().ok  # other.md and the new version are whole
    assert all(h.doc_id != old for h in tiny_rag.retrieve("okapi glacier", k=50))

    again = tiny_rag.ingest(paths=["notes.md"], progress=False)
    assert again.skipped == (new,) and not again.replaced and rows.rows == v2.num_chunks
    kept = tiny_rag.ingest(texts=[prose(14, 30)], metadata={"source": "notes.md"}, replace=False)
    assert not kept.replaced and new in tiny_rag.documents()


def test_skipped_files_are_counted(tiny_llama_dir, tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.md").write_text(prose(20, 40))
    (docs / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    argv = ["ingest", str(docs), "--store", str(tmp_path / "store"), "--no-progress"]
    argv += ["--chunk-tokens", "32", "--model", str(tiny_llama_dir), "--dtype", "float32"]
    argv += QUIET_FLAGS
    assert main([*argv, "--strict"]) == 2
    assert "latin1.txt: not UTF-8 text" in capsys.readouterr().err
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert f"warning: skipped {docs / 'latin1.txt'}: not UTF-8 text (byte 3)" in err
    assert "1 document(s) added" in out and "1 unreadable file(s) skipped" in out
    (docs / "good.md").write_text(prose(21, 40))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "replaced" in out and "1 older version(s) replaced" in out
    assert main(["docs", "list", "--store", str(tmp_path / "store")]) == 0
    assert "1 document(s)" in capsys.readouterr().out
