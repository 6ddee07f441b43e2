"""A real headless Chromium for the ``/ui`` tests, driven by Playwright's Python API.

Playwright's own browser downloads are not used: Debian's ``chromium`` package is (``.ci/run``
installs it), launched with a fresh profile and no network beyond the test server. Without
Playwright or without Chromium the tests skip, saying which is missing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 900}


def chromium_path() -> str:
    """Debian's Chromium, or a skip that says how to get it."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no Chromium to drive: `apt-get install chromium` (.ci/run installs it)")
    return found


@contextmanager
def chromium(profile: Path) -> Iterator:
    """A Playwright browser context on a fresh profile at ``profile``; pages it opens share
    nothing but the profile (``sessionStorage``, where the page keeps the API key, is per tab)."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="Playwright is not installed (it is in the dev extra)"
    )
    executable = chromium_path()
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=executable,
            args=CHROMIUM_ARGS,  # the profile is Playwright's argument, not a flag
            headless=True,
            viewport=VIEWPORT,
        )
        try:
            yield context
        finally:
            context.close()


class Page:
    """One tab on the page, with what the browser reported: console errors, CSP violations,
    uncaught exceptions."""

    def __init__(self, context, url: str) -> None:
        self.page = context.new_page()
        self.console: list[str] = []
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)

    def csp_violations(self) -> list[str]:
        return [m for m in self.console if "Content Security Policy" in m]

    def use_key(self, key: str) -> None:
        """Type the API key into the page's key form, as a user does."""
        page = self.page
        page.wait_for_selector("#key-panel:not([hidden])")
        page.fill("#key-input", key)
        page.click("#key-form button[type=submit]")
        page.wait_for_selector("#key-panel", state="hidden")

    def ask(self, question: str, timeout_ms: float = 120_000) -> None:
        """Ask on the Ask tab as it is set up, and wait until every answer has streamed."""
        page = self.page
        page.fill("#question", question)
        page.click("#ask-button")
        page.wait_for_selector("#ask-button:not([disabled])", timeout=timeout_ms)

    def texts(self, selector: str) -> list[str]:
        return self.page.locator(selector).all_text_contents()

    def close(self) -> None:
        self.page.close()
