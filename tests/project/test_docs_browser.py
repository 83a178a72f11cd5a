"""The diagrams render in a real browser, offline: the built site is served on
loopback and headless Chromium loads each page with a Mermaid diagram.

mkdocs-material replaces each ``<pre class="mermaid">`` with a
``<div class="mermaid">`` holding the SVG only once Mermaid has rendered it;
a diagram Mermaid cannot parse, or a Mermaid that did not load (the site
falls back to unpkg.com), leaves the source text instead. Every request that
is not to the loopback server is aborted, so "offline" is enforced, not assumed.

Chromium comes from Debian (`.ci/docs-tools` installs it for `make test`) and
is driven by Playwright, which waits for what the page must show (bounded)
instead of dumping the DOM after a fixed budget: the search index is built in
a web worker that headless Chromium's virtual time never waited for, and on a
loaded machine three dumps in a row came back before it answered.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Route, sync_playwright

import docs_hooks
from tests._tools import missing
from tests.project.test_docs import ROOT
from tests.project.test_docs_site import build

pytestmark = pytest.mark.slow  # builds the site and starts a browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: The pages whose diagrams are checked: every page with a ```mermaid fence.
PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if "```mermaid" in p.read_text())
#: How long a page may take to show what it must (ms): a bound, not a pace.
WAIT_MS = 60_000
#: What the theme may ask the internet for, degrading without it: its web font
#: and the repository's star count. Anything else off loopback fails the test.
OPTIONAL_ORIGINS = ("https://fonts.googleapis.com/", "https://api.github.com/repos/")


def fences(page: Path) -> int:
    return len(re.findall(r"^```mermaid$", page.read_text(), re.MULTILINE))


@pytest.fixture(scope="module")
def site_url() -> Iterator[str]:
    if docs_hooks.mermaid_js() is None:
        if shutil.which("npm") is None:
            missing("no npm to fetch Mermaid with", "python docs_hooks.py fetch-mermaid")
        docs_hooks.fetch_mermaid()
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        done = build(site)
        assert done.returncode == 0, done.stdout + done.stderr
        handler = functools.partial(QuietHandler, directory=str(site))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if CHROMIUM is None:
        missing("chromium is not installed", "apt-get install chromium; .ci/docs-tools")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield launched
        finally:
            launched.close()


class Visit:
    """One page in a fresh browser context: its console errors and blocked requests."""

    def __init__(self, browser: Browser, site_url: str) -> None:
        self.context = browser.new_context(service_workers="block")
        self.page: Page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.errors: list[str] = []
        self.blocked: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self.errors.append(f"pageerror: {error}"))
        self.context.route("**/*", functools.partial(self._offline, site_url))

    def _console(self, message: ConsoleMessage) -> None:
        # An aborted request logs ERR_FAILED; self.blocked holds which one it was.
        if message.type == "error" and "net::ERR_FAILED" not in message.text:
            self.errors.append(message.text)

    def _offline(self, site_url: str, route: Route) -> None:
        if route.request.url.startswith(site_url):
            route.continue_()
        else:
            if not route.request.url.startswith(OPTIONAL_ORIGINS):
                self.blocked.append(route.request.url)
            route.abort()

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def visit(browser: Browser, site_url: str) -> Iterator[Visit]:
    opened = Visit(browser, site_url)
    try:
        yield opened
    finally:
        opened.close()


def test_every_page_with_diagrams_is_checked() -> None:
    names = [p.name for p in PAGES]
    assert "index.md" in names
    assert "how-it-works.md" in names


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_each_diagram_renders_offline_with_the_mermaid_the_site_serves(
    visit: Visit, site_url: str, page: Path
) -> None:
    path = "" if page.stem == "index" else f"{page.stem}/"
    visit.page.goto(site_url + path)
    expected = fences(page)
    # Rendered: every <pre class="mermaid"> replaced by its <div> (whose SVG sits
    # in a closed shadow root, out of the DOM's reach), within the bound.
    visit.page.wait_for_function(
        "n => document.querySelectorAll('div.mermaid').length >= n"
        " && !document.querySelector('pre.mermaid')",
        arg=expected,
    )
    dom = visit.page.content()
    assert "assets/javascripts/mermaid.min.js" in dom  # served by the site, not unpkg
    assert dom.count('<div class="mermaid"') == expected
    assert "sequenceDiagram" not in dom  # no diagram left as its source text
    assert (visit.blocked, visit.errors) == ([], [])


def test_search_finds_a_page_in_the_browser_offline(visit: Visit, site_url: str) -> None:
    """mkdocs-material's search (lunr in a web worker, from the site's own index)."""
    visit.page.goto(site_url + "?q=create-guard")
    meta = visit.page.locator(".md-search-result__meta")
    meta.filter(has_text=re.compile(r"\d+ matching document")).wait_for()
    found = re.search(r"(\d+) matching document", meta.inner_text())
    assert found, meta.inner_text()
    assert int(found.group(1)) >= 1
    links = visit.page.locator(".md-search-result__link").evaluate_all(
        "links => links.map(a => a.href)"
    )
    assert any(link.startswith(site_url + "cli/") for link in links), links
    assert (visit.blocked, visit.errors) == ([], [])
