"""What a package index and a stranger's ``pip install`` get: one version,
the licence named and shipped, the project's links, ranges in the extras
(exact pins only in constraints/test.txt), a README whose links work off the
repository, and a wheel that runs the quickstart from a fresh venv."""

from __future__ import annotations

import email.parser
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from packaging.requirements import Requirement

import sa_fence
from tests._fresh_venv import CONSTRAINTS, Dist, FreshVenvs
from tests.project.test_docs import assert_the_quickstart_output, run_guide_block

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
URLS = {
    "Homepage": "https://github.com/sa-fence/sa-fence",
    "Documentation": "https://sa-fence.github.io/sa-fence/",
    "Source": "https://github.com/sa-fence/sa-fence",
    "Changelog": "https://github.com/sa-fence/sa-fence/blob/main/CHANGELOG.md",
    "Issues": "https://github.com/sa-fence/sa-fence/issues",
}
#: a Markdown link or image target: [text](target)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pinned(path: Path) -> dict[str, str]:
    """``name: version`` of each ``name==version`` line of a constraints file."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
            pins[req.name.lower()] = spec.version
    return pins


def test_the_version_is_written_once_and_the_attribute_the_metadata_and_the_cli_agree() -> None:
    project = PYPROJECT["project"]
    assert "version" not in project, "pyproject.toml must not repeat the version"
    assert "version" in project["dynamic"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "sa_fence/__init__.py"
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|a\d+|b\d+|rc\d+)?", sa_fence.__version__)
    assert metadata.version("sa-fence") == sa_fence.__version__
    cli = subprocess.run(
        [sys.executable, "-m", "sa_fence", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert cli.stdout.strip() == f"sa-fence {sa_fence.__version__}"


def test_the_extras_give_ranges_and_the_constraints_pin_each_of_them() -> None:
    pins = pinned(CONSTRAINTS)
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        for line in requirements:
            req = Requirement(line)
            exact = [s for s in req.specifier if s.operator in ("==", "===")]
            assert exact == [], f"extra {extra!r} pins {line!r}: give a range, pin in {CONSTRAINTS}"
            if extra in ("test", "bench"):
                assert req.name.lower() in pins, f"{req.name} ({extra}) has no pin in {CONSTRAINTS}"
                assert req.specifier.contains(pins[req.name.lower()], prereleases=True), (
                    f"{CONSTRAINTS.name} pins {req.name}=={pins[req.name.lower()]}, "
                    f"outside the extra's {req.specifier}"
                )
    for line in PYPROJECT["project"]["dependencies"]:
        req = Requirement(line)
        assert not [s for s in req.specifier if s.operator == "=="], line
        # CI installs a new release of a dependency only when its pin moves here
        assert req.name.lower() in pins, f"dependency {req.name} has no pin in {CONSTRAINTS}"
        assert req.specifier.contains(pins[req.name.lower()], prereleases=True), line


def test_the_floors_the_dependencies_name_are_the_versions_make_test_floors_runs() -> None:
    """Each ``>=`` bound of a dependency is pinned exactly in constraints/floors.txt (an
    extra of it, psycopg[binary], at the same version), so the floors are tested."""
    floors = pinned(ROOT / "constraints" / "floors.txt")
    for line in [
        *PYPROJECT["project"]["dependencies"],
        *PYPROJECT["project"]["optional-dependencies"]["otel"],
    ]:
        req = Requirement(line)
        (bound,) = [s.version for s in req.specifier if s.operator == ">="]
        for name in [req.name, *(f"{req.name}-{extra}" for extra in req.extras)]:
            assert floors.get(name.lower()) == bound, (
                f"{line!r}: constraints/floors.txt must pin {name}=={bound} (`make test-floors`)"
            )
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    test = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    assert test is not None
    assert "bash .ci/tests" in test.group(1)  # make test's stages
    stages = (ROOT / ".ci" / "tests").read_text(encoding="utf-8")
    assert "make --no-print-directory test-floors-suites" in stages
    assert "make --no-print-directory test-floors-topologies" in stages


def test_the_makefile_installs_the_test_extra_with_the_constraints_and_the_demo_without() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    installs = re.findall(r"^\t.*pip install.*$", makefile, flags=re.MULTILINE)
    for line in installs:
        if "[test" in line:
            assert "-c $(CONSTRAINTS)" in line, line
    assert re.search(r"^CONSTRAINTS\s*:=\s*constraints/test\.txt$", makefile, flags=re.MULTILINE)
    demo = re.search(r"^demo:(.*)$", makefile, flags=re.MULTILINE)
    assert demo is not None
    assert "$(STAMP)" not in demo.group(1).split(), "make demo must not install the test extra"


def test_the_readme_links_are_absolute_so_they_work_on_a_package_index() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = LINK.findall(readme)
    assert targets, "the README links to its docs"
    relative = [t for t in targets if not t.startswith(("https://", "#"))]
    assert relative == [], f"README.md links that break off the repository: {relative}"
    docs = [t for t in targets if t.startswith(URLS["Documentation"])]
    for target in docs:  # each docs link names a page that exists
        page = target.removeprefix(URLS["Documentation"]).split("#")[0].strip("/")
        if page:
            assert (ROOT / "docs" / f"{page}.md").is_file(), f"{target}: no docs/{page}.md"


@pytest.mark.slow
def test_the_sdist_and_the_wheel_pass_twine_check_and_name_their_licence_and_links(
    dist: Dist,
) -> None:
    subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dist.sdist), str(dist.wheel)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = wheel.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        assert wheel.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert meta["Version"] == sa_fence.__version__
    assert meta["License-Expression"] == "MIT"
    assert meta.get_all("License-File") == ["LICENSE"]
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert urls == URLS
    assert meta["Description-Content-Type"] == "text/markdown"
    assert not [t for t in LINK.findall(meta.get_payload()) if not t.startswith(("https://", "#"))]
    with tarfile.open(dist.sdist) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        assert {f"{top}/LICENSE", f"{top}/PKG-INFO", f"{top}/constraints/test.txt"} <= set(
            sdist.getnames()
        )
    assert "MIT License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "sa-fence developers" in (ROOT / "LICENSE").read_text(encoding="utf-8")


@pytest.mark.slow
def test_the_wheel_in_a_fresh_venv_runs_the_quickstart_with_no_checkout_on_the_path(
    fresh_venvs: FreshVenvs,
    database_url: sa.URL,
    redis_client: redis.Redis,
    key_prefix: str,
    tmp_path: Path,
) -> None:
    venv = fresh_venvs.with_install_line(("sa-fence",))
    where = subprocess.run(
        [str(venv.python), "-c", "import sa_fence; print(sa_fence.__file__, sa_fence.__version__)"],
        cwd=tmp_path,
        env=venv.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    path, version = where.stdout.split()
    assert Path(path).is_relative_to(venv.root), f"imported {path}, not the installed wheel"
    assert version == sa_fence.__version__
    cli = subprocess.run(
        [str(venv.bin / "sa-fence"), "--version"],
        cwd=tmp_path,
        env=venv.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert cli.stdout.strip() == f"sa-fence {sa_fence.__version__}"
    lines = run_guide_block("Quickstart", database_url, key_prefix, tmp_path, venv=venv)
    assert_the_quickstart_output(lines, redis_client, key_prefix)


def test_the_files_sent_first_to_the_test_workers_exist() -> None:
    """tests/conftest.py's LONGEST_FIRST names files; one renamed away would silently
    lose its place at the front (and the run's balance)."""
    from tests.conftest import LONGEST_FIRST

    assert [path for path in LONGEST_FIRST if not (ROOT / path).is_file()] == []
