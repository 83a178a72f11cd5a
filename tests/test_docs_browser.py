"""The diagrams render in a real browser, offline: the built site is served on
loopback and headless Chromium loads each page with a Mermaid diagram.

mkdocs-material replaces each ``<pre class="mermaid">`` with a
``<div class="mermaid">`` holding the SVG only once Mermaid has rendered it;
a diagram Mermaid cannot parse, or a Mermaid that did not load (the site
falls back to unpkg.com, unreachable here), leaves the source text instead.
Chromium comes from Debian (`.ci/docs-tools` installs it for `make test`);
the test is skipped where it is missing.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import docs_hooks
from tests.test_docs import ROOT
from tests.test_docs_site import build

pytestmark = pytest.mark.slow  # builds the site and starts a browser per page

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: The pages whose diagrams are checked: every page with a ```mermaid fence.
PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if "```mermaid" in p.read_text())


def fences(page: Path) -> int:
    return len(re.findall(r"^```mermaid$", page.read_text(), re.MULTILINE))


@pytest.fixture(scope="module")
def site_url() -> Iterator[str]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/docs-tools)")
    if docs_hooks.mermaid_js() is None:
        if shutil.which("npm") is None:
            pytest.skip("no npm to fetch Mermaid with (python docs_hooks.py fetch-mermaid)")
        docs_hooks.fetch_mermaid()
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        done = build(site)
        assert done.returncode == 0, done.stdout + done.stderr
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


def browse(url: str) -> tuple[str, str]:
    """(the DOM after scripts ran, the browser's console log) of ``url``."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=10000",
                "--enable-logging=stderr",
                "--v=0",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    console = "\n".join(line for line in done.stderr.splitlines() if ":CONSOLE" in line)
    return done.stdout, console


def test_every_page_with_diagrams_is_checked() -> None:
    names = [p.name for p in PAGES]
    assert "index.md" in names
    assert "how-it-works.md" in names


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_each_diagram_renders_offline_with_the_mermaid_the_site_serves(
    site_url: str, page: Path
) -> None:
    path = "" if page.stem == "index" else f"{page.stem}/"
    dom, console = browse(site_url + path)
    assert "assets/javascripts/mermaid.min.js" in dom  # served by the site, not unpkg
    assert "Error" not in console, console
    assert dom.count('<div class="mermaid"') == fences(page), console
    assert "sequenceDiagram" not in dom  # no diagram left as its source text


def test_search_finds_a_page_in_the_browser_offline(site_url: str) -> None:
    """mkdocs-material's search (lunr in a web worker, from the site's own index)."""
    # The index is built in a web worker, which headless Chromium's virtual time
    # does not wait for: on a loaded machine one load may dump the page before
    # the worker answers, so the same load is tried up to three times.
    for _ in range(3):
        dom, console = browse(site_url + "?q=create-guard")
        assert "Error" not in console, console
        results = re.search(r'class="md-search-result__meta">\s*(\d+) matching document', dom)
        if results:
            break
    assert results, dom[-2000:]
    assert int(results.group(1)) >= 1
    assert 'href="' + site_url + "cli/" in dom or 'href="cli/' in dom
