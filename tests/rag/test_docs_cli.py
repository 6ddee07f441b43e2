"""``blendkv docs list|show|delete`` and ``ask --filter`` on a store the tiny model built: two
files sharing their first paragraph (so one stored chunk), and a third.

``docs`` loads no model (``LLM`` is made to fail here); deleting one of the two files keeps the
shared chunk for the other, and the store verifies clean after it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers import QUIET_FLAGS

from blendkv.cli import main
from blendkv.entrypoints.llm import LLM
from blendkv.rag.catalog import DocumentCatalog

pytestmark = pytest.mark.slow

SHARED = "This bundle is released under the Orchard Licence, version two, by the Fruit Society."
TEXTS = {
    "apples.md": SHARED + "\n\nApples grow on trees in the orchard and ripen in late September.",
    "pears.md": SHARED + "\n\nPears grow in the valley and are picked before they are ripe.",
    "bridge.txt": "The Copper Bridge over the Slate River opened to trains in 1903.",
}


@pytest.fixture(scope="module")
def ingested(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs-cli")
    paths = {}
    for name, text in TEXTS.items():
        paths[name] = folder / name
        paths[name].write_text(text)
    model = ["--model", str(tiny_llama_dir), "--dtype", "float32", *QUIET_FLAGS]
    args = [*map(str, paths.values()), "--chunk-tokens", "32", "--no-progress"]
    assert main(["ingest", *args, "--store", str(folder / "store"), *model]) == 0
    return folder / "store", {k: str(v) for k, v in paths.items()}, model


@pytest.fixture
def built(ingested, tmp_path, capsys):
    """The ingested store, copied: each test may change its own."""
    store, paths, model = ingested
    shutil.copytree(store, tmp_path / "store")
    capsys.readouterr()
    return tmp_path / "store", paths, model


def _docs(capsys, *argv) -> tuple[int, str, str]:
    code = main(["docs", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("docs must not load a model")

    monkeypatch.setattr(LLM, "__init__", refuse)


def test_docs_list_show_delete_keep_shared_chunks(built, capsys, no_model):
    store, paths, _ = built
    catalog = DocumentCatalog(store)
    by_source = {e["source"]: d for d, e in catalog.documents().items()}
    apples, pears = by_source[paths["apples.md"]], by_source[paths["pears.md"]]
    # The shared paragraph's chunks are stored once and listed by both documents.
    shared = set(catalog.chunk_keys(apples)) & set(catalog.chunk_keys(pears))
    assert shared and catalog.chunk_keys(pears)[0] in shared

    code, out, _ = _docs(capsys, "list", "--store", str(store), "--json")
    listed = json.loads(out)["documents"]
    assert code == 0 and {d["source"] for d in listed} == set(paths.values())
    assert all(d["num_chunks"] >= 1 and d["added"] > 0 for d in listed)
    code, out, _ = _docs(capsys, "list", "--store", str(store))
    assert code == 0 and paths["pears.md"] in out and "3 document(s)" in out

    code, out, _ = _docs(capsys, "show", paths["pears.md"], "--store", str(store))
    assert code == 0 and f"doc_id    {pears}" in out and "Pears grow" in out
    code, out, _ = _docs(capsys, "show", pears, "--store", str(store), "--json")
    [shown] = json.loads(out)["documents"]
    assert shown["source"] == paths["pears.md"] and shown["chunks"][0]["text"].startswith("This")

    code, out, err = _docs(capsys, "delete", paths["apples.md"], "nosuch", "--store", str(store))
    assert code == 2 and "no document 'nosuch'" in err  # checked before anything is deleted
    assert apples in DocumentCatalog(store)
    code, out, _ = _docs(capsys, "delete", paths["apples.md"], "--store", str(store), "--json")
    [done] = json.loads(out)["deleted"]
    assert code == 0 and done["doc_id"] == apples
    assert done["kept"] == len(shared) and done["removed"] >= 1  # apples' own chunks went

    assert main(["store", "verify", "--store", str(store)]) == 0
    assert ": OK" in capsys.readouterr().out
    code, out, _ = _docs(capsys, "show", pears, "--store", str(store), "--json")
    [shown] = json.loads(out)["documents"]
    assert all(c["chunk_id"] is not None for c in shown["chunks"])  # pears is whole
    assert _docs(capsys, "show", apples, "--store", str(store))[0] == 2


def test_ask_prints_sources_and_filters(built, capsys):
    store, paths, model = built
    ask = ["ask", "Where do pears grow?", "--store", str(store), "--max-tokens", "2", *model]
    assert main([*ask, "--top-k", "3", "--filter", f"source={paths['bridge.txt']}", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    [bridge] = [e for e in DocumentCatalog(store).documents().values() if "bridge" in e["source"]]
    assert len(record["sources"]) == min(3, bridge["num_chunks"])  # all it has, up to k
    assert {s["source"] for s in record["sources"]} == {paths["bridge.txt"]}
    filters = [f"--filter=source={paths[name]}" for name in ("apples.md", "pears.md")]
    assert main([*ask, "--top-k", "9", *filters, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert {s["source"] for s in record["sources"]} == {paths["apples.md"], paths["pears.md"]}
    assert main([*ask, "--top-k", "1"]) == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.strip().startswith("[1]")]
    assert any(p in line for p in paths.values())  # the file, not only a doc id
    assert main([*ask, "--filter", "source=nowhere.md"]) == 2
    assert "no document matches the filter" in capsys.readouterr().err


def test_docs_list_survives_a_closed_pipe(built):
    store, _, _ = built
    cmd = f"{sys.executable} -m blendkv.cli docs list --store {store} | head -c 1"
    done = subprocess.run(cmd, shell=True, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stderr == "", done.stderr
