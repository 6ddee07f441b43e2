"""The ``/ui`` page in a real headless Chromium (browser.py) on the real server (uvicorn) over a
small store: it asks and streams the answer, lists the sources, colours the token map with the
engine's counts, pages through and deletes from the store, draws the health charts; and it is
safe by construction (documents render as text, a CSP, no key no data, deletion needs the key).

One server with a store and an API key, one with neither, one browser for the module. With
``--ui-screenshots DIR`` the keyed server runs the embedded model over the demo documents and the
screenshots land in DIR (``docs/images`` holds the docs' ones); without it, the tiny random model
(its answers are noise, the counts are what is checked) and a temporary folder.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from browser import Page, chromium
from helpers import QuietLLM
from server_helpers import make_tiny_chat_model_dir, raw_request, running_server, wait_for

import blendkv.rag
from blendkv.entrypoints.openai.api_server import ServeConfig, create_app
from blendkv.entrypoints.openai.ui import ASSETS, CONTENT_SECURITY_POLICY, asset_bytes
from blendkv.rag import RAGPipeline

pytestmark = pytest.mark.timeout(900)

API_KEY = "ui-test-key"
QUESTION = "Who created the Python programming language?"
TOP_K = 3
MAX_TOKENS = 24
# Every blended request is audited (a full prefill when the engine idles): the health tab's
# audit chart has points. No prefix cache: the page and the API get the same blend.
ENGINE = dict(dtype="float32", max_model_len=1024, enable_prefix_caching=False, blend_audit_rate=1)
SCRIPT = "<script>document.title = 'pwned'</script><img src=x onerror=\"document.title='pwned'\">"
NOTES = 55  # more documents than a page of the Store tab holds (50)
KINDS = ("prefix_cached", "reused", "corrected", "recomputed", "computed")


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def screenshots(request, tmp_path_factory) -> Path:
    given = request.config.getoption("--ui-screenshots")
    if given is None:
        return tmp_path_factory.mktemp("ui-screenshots")
    Path(given).mkdir(parents=True, exist_ok=True)
    return Path(given)


@pytest.fixture(scope="module")
def model(request, tmp_path_factory) -> str | None:
    if request.config.getoption("--ui-screenshots") is not None:
        return None  # the embedded SmolLM2-135M-Instruct: answers worth a screenshot
    return str(make_tiny_chat_model_dir(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="module")
def engine(request) -> dict:
    """The engine options; for the docs' screenshots with the warm-up a real server runs (its
    first requests would show one-time costs)."""
    return {**ENGINE, "warmup": request.config.getoption("--ui-screenshots") is not None}


@pytest.fixture(scope="module")
def store(model, engine, tmp_path_factory) -> Path:
    """The demo documents, a note quoting HTML, and enough notes for two pages."""
    corpus = tmp_path_factory.mktemp("corpus")
    for path in (Path(blendkv.rag.__file__).parent / "demo_docs").iterdir():
        shutil.copy(path, corpus / path.name)
    (corpus / "markup.md").write_text(f"# Markup\n\nThis note quotes HTML: {SCRIPT} It shows.\n")
    (corpus / "notes").mkdir()
    for i in range(NOTES):
        text = f"Note {i}: the warehouse in district {i} holds {i * 13} crates of apples."
        (corpus / "notes" / f"note-{i:02d}.txt").write_text(text)
    path = tmp_path_factory.mktemp("ui-store") / "demo-store"
    llm = QuietLLM(model, **engine)
    try:
        with RAGPipeline(path, llm=llm) as rag:
            rag.ingest([corpus], progress=False)
    finally:
        llm.close()
    return path


@pytest.fixture(scope="module")
def server(model, engine, store):
    config = ServeConfig(api_key=API_KEY, store_dir=str(store))
    app = create_app(lambda: QuietLLM(model, **engine), config)
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def open_server(model, engine):
    """No API key, no store: documents come in requests."""
    app = create_app(lambda: QuietLLM(model, **engine), ServeConfig())
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


def page_on(browser, url: str, key: str | None = API_KEY) -> Page:
    page = Page(browser, f"{url}/ui")
    if key is not None:
        page.use_key(key)
    page.page.wait_for_selector("#server[data-state]")  # the server's info came back
    return page


def rag_body(stream: bool = False) -> dict:
    """The chat request the page sends for QUESTION against the store (as app.js builds it)."""
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "token_map": True,
        "rag": {"top_k": TOP_K},
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def post(url: str, path: str, body: dict, key: str | None = API_KEY):
    status, _, out = raw_request(url, "POST", path, body, api_key=key)
    assert status == 200, out
    return out


def check_counts(counts: dict[str, int], stats: dict, num_prompt_tokens: int) -> None:
    """The token map's counts add up to the prompt and agree with the blend stats."""
    assert set(counts) == set(KINDS)
    assert sum(counts.values()) == num_prompt_tokens == stats["num_prompt_tokens"]
    assert counts["recomputed"] == stats["reused_tokens_recomputed"]
    assert counts["reused"] + counts["corrected"] == stats["reused_tokens_kept"]
    assert counts["computed"] == stats["other_tokens_computed"]
    assert counts["prefix_cached"] == stats["prefix_cached_tokens"]


def file_name(source: str) -> str:
    return Path(source).name


# ------------------------------------------------------------------------ the API
def test_token_map_in_chat_completions_matches_the_blend_stats(server):
    out = post(server, "/v1/chat/completions", rag_body())
    info = out["blendkv"]
    tm = info["token_map"]
    n = out["usage"]["prompt_tokens"]
    check_counts(tm["counts"], info, n)
    assert len(tm["kinds"]) == len(tm["tokens"]) == len(tm["token_ids"]) == n
    assert {k: tm["kinds"].count(c) for c, k in tm["legend"].items()} == tm["counts"]
    assert info["tokens_reused"] > 0 and tm["counts"]["recomputed"] > 0  # a real blend
    assert len(tm["chunk_spans"]) == len(info["sources"]) == TOP_K
    for i, (start, end) in enumerate(tm["chunk_spans"]):
        assert tm["chunks"][start:end] == [i] * (end - start)
        assert tm["offsets"][start:end] == list(range(end - start))
    assert tm["selections"] == [{"layer": 0, "score": "prophet"}]  # the default selection
    assert sum(tm["query_mass"]) == pytest.approx(1, abs=1e-3)
    # The same, streamed: the map rides on the last chunk's blendkv field.
    status, _, text = raw_request(server, "POST", "/v1/chat/completions", rag_body(True), API_KEY)
    assert status == 200
    infos = [c["blendkv"] for c in _events(text) if c.get("blendkv")]
    assert len(infos) == 1 and infos[0]["token_map"]["kinds"] == tm["kinds"]
    # Not asked for: not there (and not recorded).
    plain = post(server, "/v1/chat/completions", {**rag_body(), "token_map": False})
    assert "token_map" not in plain["blendkv"]


def test_token_map_needs_documents(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "token_map": True}
    status, _, body = raw_request(server, "POST", "/v1/chat/completions", chat, API_KEY)
    assert status == 400 and body["error"]["param"] == "token_map"
    completion = {"prompt": "hi", "max_tokens": 2, "token_map": True}
    status, _, body = raw_request(server, "POST", "/v1/completions", completion, API_KEY)
    assert status == 400 and body["error"]["param"] == "token_map"


def test_documents_api_pages_filters_and_shows(server):
    status, _, first = raw_request(server, "GET", "/v1/blendkv/documents?limit=20", None, API_KEY)
    assert status == 200 and len(first["data"]) == 20 and first["has_more"]
    total = first["total"]
    assert total >= NOTES + 4
    _, _, last = raw_request(
        server, "GET", f"/v1/blendkv/documents?offset={total - 5}&limit=20", None, API_KEY
    )
    assert len(last["data"]) == 5 and not last["has_more"]
    for doc in first["data"]:
        assert doc["num_chunks"] >= 1 and doc["num_tokens"] > 0 and doc["nbytes"] > 0
    _, _, notes = raw_request(server, "GET", "/v1/blendkv/documents?q=NOTE-0", None, API_KEY)
    assert sorted(file_name(d["source"]) for d in notes["data"]) == [
        f"note-0{i}.txt" for i in range(10)
    ]
    doc = notes["data"][0]
    status, _, shown = raw_request(
        server, "GET", f"/v1/blendkv/documents/{doc['doc_id']}", None, API_KEY
    )
    assert status == 200 and shown["data"][0]["chunks"][0]["text"].startswith("Note 0")
    status, _, body = raw_request(server, "GET", "/v1/blendkv/documents/nope", None, API_KEY)
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, _, _ = raw_request(server, "GET", "/v1/blendkv/documents?limit=100000", None, API_KEY)
    assert status == 400


def test_info_says_what_the_server_offers(server, open_server):
    _, _, keyed = raw_request(server, "GET", "/v1/blendkv/info", None, API_KEY)
    assert keyed["api_key"] and keyed["can_delete"] and keyed["store"]["name"] == "demo-store"
    assert keyed["blend_audit_rate"] == 1
    _, _, open_ = raw_request(open_server, "GET", "/v1/blendkv/info")
    assert not open_["api_key"] and not open_["can_delete"] and open_["store"] is None
    # Deleting needs a key to exist: a server anyone can reach never deletes.
    status, _, body = raw_request(open_server, "DELETE", "/v1/blendkv/documents/x")
    assert status == 403 and body["error"]["code"] == "api_key_required"
    status, _, _ = raw_request(open_server, "GET", "/v1/blendkv/documents")
    assert status == 404  # no store


def test_page_files_carry_a_csp_and_hold_no_inline_code(server):
    for path, (_, media) in ASSETS.items():
        status, headers, _ = raw_request(server, "GET", path)  # no key: the files hold no data
        assert status == 200, path
        assert headers["content-type"] == media
        assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "default-src 'self'" in CONTENT_SECURITY_POLICY
        assert headers["x-content-type-options"] == "nosniff"
    assert raw_request(server, "HEAD", "/ui")[0] == 200
    html = asset_bytes("index.html").decode()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="ui/app.js" defer>']
    assert not re.search(r"\sstyle=|\son[a-z]+=|javascript:|https?://", html)
    script = asset_bytes("app.js").decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink


def test_without_the_key_the_page_and_its_api_refuse(server, browser):
    for key in (None, "wrong-key"):
        for method, path in (
            ("GET", "/v1/blendkv/info"),
            ("GET", "/v1/blendkv/documents"),
            ("GET", "/v1/blendkv/documents/x"),
            ("DELETE", "/v1/blendkv/documents/x"),
            ("GET", "/v1/blendkv/health"),
        ):
            assert raw_request(server, method, path, None, key)[0] == 401, (method, path)
        status, _, _ = raw_request(server, "POST", "/v1/chat/completions", rag_body(), key)
        assert status == 401
    page = page_on(browser, server, key=None)
    p = page.page
    p.wait_for_selector("#key-panel:not([hidden])")
    assert "API key" in p.text_content("#server")
    p.click('.tab[data-tab="store"]')
    assert page.texts("#store-rows tr") == []  # nothing listed
    p.fill("#key-input", "wrong-key")
    p.click("#key-form button[type=submit]")
    p.wait_for_selector("#key-message:has-text('refused')")
    assert p.is_visible("#key-panel")
    page.use_key(API_KEY)  # the right key opens it
    p.wait_for_selector("#store-rows tr")
    assert page.errors == [] and page.csp_violations() == []
    page.close()


def test_ask_streams_the_answer_sources_and_token_map(server, browser, screenshots):
    ref = post(server, "/v1/chat/completions", rag_body())
    info, tm = ref["blendkv"], ref["blendkv"]["token_map"]
    n = ref["usage"]["prompt_tokens"]
    page = page_on(browser, server)
    p = page.page
    p.fill("#top-k", str(TOP_K))
    p.click(".options summary")
    p.fill("#max-tokens", str(MAX_TOKENS))
    p.check("#compare-full")
    page.ask(QUESTION)
    assert p.text_content("#ask-error") == ""
    # The streamed answer is the API's; full prefill ran on the same prompt tokens.
    assert p.text_content("#answer-blend .text") == ref["choices"][0]["message"]["content"]
    full = post(
        server,
        "/v1/completions",
        {"prompt": tm["token_ids"], "max_tokens": MAX_TOKENS, "temperature": 0},
    )
    assert p.is_visible("#answer-full")
    assert p.text_content("#answer-full .text") == full["choices"][0]["text"]
    assert "first token after" in p.text_content("#answer-blend .ttft")
    # The default config is a fidelity target: the summary says what it ran at.
    target = f"fidelity target {info['fidelity_target']:g} nats: recompute ratio"
    assert target in p.text_content("#summary")
    # Sources: file names in prompt order.
    names = page.texts("#source-list li .name")
    assert names == [file_name(s["source"]) for s in info["sources"]]
    # The token map: the legend's counts add up to the prompt and match the blend stats.
    counts = {}
    for item in p.locator("#legend .item").all():
        counts[item.get_attribute("data-kind")] = int(item.get_attribute("data-count"))
    assert counts == tm["counts"]
    check_counts(counts, info, n)
    assert p.text_content("#map-total") == f"{n} prompt tokens"
    tokens = page.texts("#tokens .t")
    assert len(tokens) == n and "".join(tokens) == "".join(tm["tokens"])
    for code, kind in tm["legend"].items():
        assert p.locator(f"#tokens .t.k-{code}").count() == counts[kind]
    # Hovering a recomputed token says what happened to it.
    p.hover("#tokens .t.k-r >> nth=0")
    p.wait_for_selector("#tooltip:not([hidden])")
    tip = p.text_content("#tooltip")
    assert "recomputed" in tip and "chunk" in tip and "selection score (prophet)" in tip
    p.screenshot(path=str(screenshots / "ui-token-map.png"))
    p.mouse.move(0, 0)
    p.screenshot(path=str(screenshots / "ui-ask.png"), full_page=True)
    assert page.errors == [] and page.csp_violations() == []
    page.close()


def test_documents_pasted_into_the_page_render_as_text(open_server, browser, tmp_path, screenshots):
    page = page_on(browser, open_server, key=None)
    p = page.page
    assert p.is_disabled("#mode-store") and p.is_checked("#mode-documents")  # no store
    p.fill(".doc-title", "<b>markup</b>.html")
    p.fill(".doc-text", f"Quoted from a web page: {SCRIPT} Python was created by Guido.")
    chosen = tmp_path / "python.md"
    chosen.write_text("Python 0.9.0 was released in February 1991.")
    p.set_input_files("#doc-files", str(chosen))  # a file chosen (or dropped) joins them
    p.wait_for_selector("#doc-list .doc:nth-child(2)")
    p.click(".options summary")
    p.fill("#max-tokens", "4")
    page.ask(QUESTION)
    assert p.text_content("#ask-error") == ""
    assert p.title() == "blendkv"  # nothing ran
    for where in ("#sources", "#tokens", "#answers"):
        assert p.locator(f"{where} script, {where} img, {where} b").count() == 0
    assert SCRIPT in p.text_content("#source-list .excerpt")
    assert page.texts("#source-list .name") == ["<b>markup</b>.html", "python.md"]
    assert "<script>" in "".join(page.texts("#tokens .t"))
    p.screenshot(path=str(screenshots / "ui-documents.png"), full_page=True)
    p.click('.tab[data-tab="store"]')
    p.wait_for_selector("#store-none:not([hidden])")
    assert page.errors == [] and page.csp_violations() == []
    page.close()


def test_store_tab_pages_filters_and_deletes_after_a_confirmation(server, browser, screenshots):
    _, _, listing = raw_request(server, "GET", "/v1/blendkv/documents?limit=1", None, API_KEY)
    total = listing["total"]
    page = page_on(browser, server)
    p = page.page
    p.click('.tab[data-tab="store"]')
    p.wait_for_selector(f"#store-range:has-text('of {total} documents')")
    assert p.text_content("#store-range") == f"1–50 of {total} documents"
    assert p.locator("#store-rows tr").count() == 50 and p.is_disabled("#store-prev")
    p.screenshot(path=str(screenshots / "ui-store.png"))
    p.click("#store-next")
    p.wait_for_selector(f"#store-range:has-text('51–{total} of')")
    assert p.locator("#store-rows tr").count() == total - 50 and p.is_disabled("#store-next")
    # The note quoting HTML: its chunk text is text.
    p.fill("#store-filter", "markup")
    p.wait_for_selector("#store-rows tr:has-text('markup.md')")
    assert p.text_content("#store-range") == "1–1 of 1 documents"
    p.click("#store-rows tr")
    p.wait_for_selector("#doc-detail pre")
    assert SCRIPT in p.text_content("#doc-detail pre")
    assert p.locator("#doc-detail script, #doc-detail img").count() == 0
    assert p.title() == "blendkv"
    # Delete: a confirmation first; Cancel keeps the document.
    p.fill("#store-filter", "note-54")
    p.wait_for_selector("#store-rows tr:has-text('note-54.txt')")
    assert p.text_content("#store-range") == "1–1 of 1 documents"
    doc_id = p.get_attribute("#store-rows tr", "data-doc-id")
    p.click("#store-rows tr button.delete")
    p.wait_for_selector("#confirm-delete")
    assert "cannot be undone" in p.text_content("#doc-detail")
    p.click("#doc-detail button.quiet")  # Cancel
    assert raw_request(server, "GET", f"/v1/blendkv/documents/{doc_id}", None, API_KEY)[0] == 200
    p.click("#store-rows tr button.delete")
    p.click("#confirm-delete")
    p.wait_for_selector("#doc-detail:has-text('Deleted')")
    assert raw_request(server, "GET", f"/v1/blendkv/documents/{doc_id}", None, API_KEY)[0] == 404
    p.wait_for_selector("#store-range:has-text('no documents')")
    _, _, after = raw_request(server, "GET", "/v1/blendkv/documents?limit=1", None, API_KEY)
    assert after["total"] == total - 1
    assert page.errors == [] and page.csp_violations() == []
    page.close()


def test_health_tab_draws_percentiles_tiers_and_audits(server, browser, screenshots):
    post(server, "/v1/chat/completions", rag_body())  # at least one blend to audit

    def health() -> dict:
        return raw_request(server, "GET", "/v1/blendkv/health", None, API_KEY)[2]

    assert wait_for(lambda: health()["audit"]["count"] >= 1, timeout=120)  # audits run idle
    h = health()
    assert h["ttft"]["count"] >= 1 and h["ttft"]["p50"] <= h["ttft"]["p90"] <= h["ttft"]["p99"]
    assert h["tiers"]["hit_rate"] is not None and h["audit"]["warn_kl"] > 0
    page = page_on(browser, server)
    p = page.page
    p.click('.tab[data-tab="health"]')
    p.wait_for_selector("#chart-audit circle")
    cards = p.text_content("#health-cards")
    assert "TTFT p50 / p90 / p99" in cards and "Chunk hit rate" in cards and "nats" in cards
    assert p.locator("#chart-ttft circle[class^=dot-]").count() >= h["ttft"]["count"]
    assert p.locator("#chart-tiers rect[class^=bar-]").count() == 4
    p.screenshot(path=str(screenshots / "ui-health.png"), full_page=True)
    assert page.errors == [] and page.csp_violations() == []
    page.close()


def _events(text: str) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
