"""mkdocs hooks (mkdocs.yml ``hooks:``): pages that may or may not exist yet,
Sphinx roles in the generated API, and Mermaid served with the site.

Later changes add ``docs/topologies.md``, ``docs/reliability.md`` and
``docs/observability.md``.  Naming a missing page in ``nav`` fails
``mkdocs build --strict``, and an existing page left out of it is reported
as omitted; so each is appended to its nav section here when its file exists.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.sa_fence")

#: (nav section, title, file) of pages listed only when present
OPTIONAL_PAGES = [
    ("Guides", "Deployment topologies", "topologies.md"),
    ("Design notes", "Reliability", "reliability.md"),
    ("Guides", "Observability", "observability.md"),
]


def on_config(config: Any) -> Any:
    if mermaid_js() is not None:
        config["extra_javascript"].append(MERMAID_SITE_PATH)
    else:
        log.info(
            "Mermaid %s is not cached (python docs_hooks.py fetch-mermaid): the diagrams "
            "load it from unpkg.com, as mkdocs-material does by default",
            MERMAID_VERSION,
        )
    docs = Path(config["docs_dir"])
    nav = config["nav"]
    for section, title, file in OPTIONAL_PAGES:
        if not (docs / file).is_file():
            continue
        for entry in nav:
            if isinstance(entry, dict) and section in entry:
                pages = entry[section]
                if not any(file in item.values() for item in pages if isinstance(item, dict)):
                    pages.append({title: file})
                break
        else:
            nav.append({title: file})
    return config


# Docstrings use Sphinx roles (:class:`~sa_fence.Lease`), which mkdocstrings
# leaves as text in front of the code span: show the code span alone, with
# the last dotted part for a "~" target, as Sphinx would.
_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc|obj):<code>(~?)([\w.]+)</code>")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if match.group(1) else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(_role, html)


# Mermaid, for the diagrams (```mermaid fences: pymdownx.superfences in
# mkdocs.yml). mkdocs-material renders them with the global ``mermaid`` when a
# page defines it, and otherwise loads mermaid@11 from unpkg.com, which a
# reader or build machine without that network cannot reach: the diagrams then
# show as their source text. No Python package ships mermaid.min.js, so
# `make docs` fetches the pinned version from the npm registry into .cache/
# (3.5 MB, never committed; the checksum is checked), and the built site serves
# it as its own asset. Bump both constants together.
MERMAID_VERSION = "11.17.2"
MERMAID_SHA256 = "581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8"
MERMAID_CACHE = Path(__file__).resolve().parent / ".cache" / f"mermaid-{MERMAID_VERSION}"
MERMAID_SITE_PATH = "assets/javascripts/mermaid.min.js"


def mermaid_js() -> Path | None:
    """The cached mermaid.min.js of :data:`MERMAID_VERSION`, if present and intact."""
    path = MERMAID_CACHE / "mermaid.min.js"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == MERMAID_SHA256:
        return path
    return None


def fetch_mermaid() -> Path:
    """``npm pack mermaid@VERSION`` and keep its dist/mermaid.min.js (and LICENSE)."""
    cached = mermaid_js()
    if cached is not None:
        return cached
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("fetch-mermaid: npm is not on PATH (Debian: apt-get install npm)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [npm, "pack", f"mermaid@{MERMAID_VERSION}", "--silent", "--pack-destination", tmp],
            check=True,
            timeout=300,
            stdout=subprocess.DEVNULL,
        )
        with tarfile.open(Path(tmp) / f"mermaid-{MERMAID_VERSION}.tgz") as tar:
            script = tar.extractfile("package/dist/mermaid.min.js")
            licence = tar.extractfile("package/LICENSE")
            if script is None or licence is None:
                raise SystemExit(f"fetch-mermaid: mermaid@{MERMAID_VERSION} has no dist file")
            data, licence_text = script.read(), licence.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != MERMAID_SHA256:
        raise SystemExit(
            f"fetch-mermaid: mermaid@{MERMAID_VERSION} dist/mermaid.min.js has SHA-256 "
            f"{digest}, expected {MERMAID_SHA256}; nothing was kept"
        )
    MERMAID_CACHE.mkdir(parents=True, exist_ok=True)
    (MERMAID_CACHE / "LICENSE").write_bytes(licence_text)
    (MERMAID_CACHE / "mermaid.min.js").write_bytes(data)
    return MERMAID_CACHE / "mermaid.min.js"


def on_post_build(config: Any) -> None:
    source = mermaid_js()
    if source is None:
        return
    target = Path(config["site_dir"]) / MERMAID_SITE_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    shutil.copyfile(MERMAID_CACHE / "LICENSE", target.with_name("mermaid.LICENSE.txt"))


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch-mermaid"]:
        raise SystemExit("usage: python docs_hooks.py fetch-mermaid")
    print(fetch_mermaid())
