"""The docs site builds: ``mkdocs build --strict`` (every link, anchor,
included recipe and generated API page resolves), and its nav takes the
pages other changes add when they exist."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sa_fence
from tests.project.test_docs import ROOT

pytestmark = pytest.mark.slow  # runs mkdocs in a subprocess


def build(site: Path, docs_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    config = ROOT / "mkdocs.yml"
    args = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)]
    cwd = ROOT
    if docs_dir is not None:  # a copy of the project, to add a page
        cwd = docs_dir.parent
        args += ["-f", str(cwd / "mkdocs.yml")]
    else:
        args += ["-f", str(config)]
    return subprocess.run(
        args,
        cwd=cwd,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    done = build(tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert "Grants leases" in api  # generated from Fencer's docstring
    assert ":class:" not in api  # Sphinx roles rendered as code
    # an entry generated for every public name, and the signatures from the code
    public = [*sa_fence.__all__, *sa_fence._LAZY]  # _LAZY: public, loaded on first use
    assert [n for n in public if f'id="sa_fence.{n}"' not in api] == []
    moved = [f"telemetry.{n}" for n in sa_fence.telemetry.__all__]
    # methods the front ends inherit from the shared lifecycle are documented on them
    for cls, methods in (
        ("Fencer", ("acquire", "check", "prune", "close", "key")),
        ("Lease", ("extend", "release", "check", "remaining", "bind")),
    ):
        for front in (cls, "Async" + cls):
            missing = [m for m in methods if f'id="sa_fence.{front}.{m}"' not in api]
            assert missing == [], front
    assert [n for n in moved if f'id="sa_fence.{n}"' not in api] == []
    fencer = api[api.index('id="sa_fence.Fencer"') :]
    fencer = re.sub(r"<[^>]+>", "", fencer[: fencer.index('id="sa_fence.Fencer.key"')])
    for parameter in ("sequence", "key_prefix", "renew_fraction", "timeout", "telemetry"):
        assert f"{parameter}:" in fencer, parameter
    celery = (tmp_path / "site" / "celery" / "index.html").read_text(encoding="utf-8")
    assert "finish_job_unless_busy" in celery  # the recipe file, included
    index = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert 'href="https://github.com/sa-fence/sa-fence"' in index  # repo_url
    assert '<link rel="canonical" href="https://sa-fence.github.io/sa-fence/">' in index
    search = json.loads((tmp_path / "site" / "search" / "search_index.json").read_text())
    found = {doc["location"].split("#")[0] for doc in search["docs"]}
    assert {"", "api/", "how-it-works/", "which-tool/", "cli/"} <= found  # search, offline
    for page, diagrams in (("index.html", 1), ("how-it-works/index.html", 2)):
        html = (tmp_path / "site" / page).read_text(encoding="utf-8")
        # a Mermaid diagram, not a code block (tests/project/test_docs_browser.py renders them)
        assert html.count('<pre class="mermaid"><code>sequenceDiagram') == diagrams, page


def test_a_page_added_later_joins_the_nav_and_strict_still_passes(tmp_path: Path) -> None:
    copy = tmp_path / "project"
    shutil.copytree(ROOT / "docs", copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("mkdocs.yml", "docs_hooks.py"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(
        ROOT / "sa_fence", copy / "sa_fence", ignore=shutil.ignore_patterns("__pycache__")
    )
    (copy / "docs" / "observability.md").write_text("# Observability\n\nMetrics.\n")
    done = build(tmp_path / "site", copy / "docs")
    assert done.returncode == 0, done.stdout + done.stderr
    index = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "observability/" in index
