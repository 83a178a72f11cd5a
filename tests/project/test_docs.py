"""The docs' claims that can be executed: the quickstart runs, every public name
is documented, and the pages speak of the product only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import sa_fence
from tests._fresh_db import fresh_database
from tests._fresh_venv import Venv
from tests._sql import recorded_statements, seed
from tests.conftest import REDIS_URL
from tests.models import Job

if TYPE_CHECKING:
    import redis
    import sqlalchemy as sa
    from sqlalchemy.orm import Session, sessionmaker

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: The executed quickstarts, by page (the guide was split into a site).
QUICKSTART = DOCS / "quickstart.md"
ASYNCIO = DOCS / "asyncio.md"


def guide_block(heading: str, page: Path = QUICKSTART) -> str:
    """The first ```python block under ``heading`` in ``page`` (not a later section's)."""
    text = page.read_text(encoding="utf-8")
    found = re.search(rf"^#+\s+{re.escape(heading)}\s*$", text, flags=re.MULTILINE)
    assert found, f"{page.relative_to(ROOT)} has no {heading!r} heading"
    block = re.compile(r"^```python\n(.*?)^```\s*$", flags=re.MULTILINE | re.DOTALL)
    match = block.search(text, found.end())
    assert match, f"no ```python block under the {heading!r} heading"
    next_heading = re.compile(r"^#+\s", flags=re.MULTILINE).search(text, found.end())
    assert next_heading is None or match.start() < next_heading.start(), (
        f"the first ```python block after {heading!r} belongs to a later section"
    )
    return match.group(1)


def run_guide_block(
    heading: str,
    database_url: sa.URL,
    key_prefix: str,
    tmp_path: Path,
    page: Path = QUICKSTART,
    venv: Venv | None = None,
) -> list[str]:
    """Run the block as a script against the test run's servers; its stdout lines.

    In a database of its own: the quickstarts create their own ``jobs`` table,
    sequence and register, as a reader's first run would.  With ``venv``, in
    that venv from ``tmp_path`` (the installed wheel, no checkout on the path);
    otherwise with this interpreter from the checkout.
    """
    return run_script(guide_block(heading, page), heading, key_prefix, tmp_path, venv)


def run_script(
    code: str | Callable[[sa.Engine], str],
    what: str,
    key_prefix: str,
    tmp_path: Path,
    venv: Venv | None = None,
) -> list[str]:
    """Run ``code`` (or what it makes of the fresh database's engine) as a script; its
    stdout lines.  See :func:`run_guide_block`."""
    script = tmp_path / "guide_block.py"
    with fresh_database("docs") as engine:
        script.write_text(code if isinstance(code, str) else code(engine), encoding="utf-8")
        values = {
            "DATABASE_URL": engine.url.render_as_string(hide_password=False),
            "REDIS_URL": REDIS_URL,
            "SA_FENCE_KEY_PREFIX": key_prefix,
        }
        proc = subprocess.run(
            [str(venv.python) if venv else sys.executable, str(script)],
            cwd=tmp_path if venv else ROOT,
            env=venv.env(values) if venv else {**os.environ, **values},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.strip().splitlines()


def assert_the_quickstart_output(
    lines: list[str], redis_client: redis.Redis, key_prefix: str
) -> None:
    assert len(lines) >= 2, lines
    assert re.fullmatch(r"A \(token \d+\) refused: row \(1,\) has fence \d+", lines[-2]), lines
    assert lines[-1] == "job 1 result: written by B", lines
    # the stale holder's token is smaller than the fence that refused it
    stale, fence = map(int, re.findall(r"\d+", lines[-2].replace("(1,)", "")))
    assert stale < fence
    # its leases are gone from Redis: released, or expired (the stale one)
    assert list(redis_client.scan_iter(match=f"{key_prefix}*")) == []


def test_the_quickstart_runs_and_refuses_the_stale_writer(
    database_url: sa.URL, redis_client: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    lines = run_guide_block("Quickstart", database_url, key_prefix, tmp_path)
    assert_the_quickstart_output(lines, redis_client, key_prefix)


def test_the_quickstart_says_how_to_create_the_database_it_defaults_to() -> None:
    """A reader without DATABASE_URL gets a database of the quickstart's own, which the
    page tells them to create (not one named ``test`` that nothing creates)."""
    default = re.search(r'"DATABASE_URL",\s*"([^"]+)"', guide_block("Quickstart"))
    assert default, "the quickstart's DATABASE_URL has no default"
    name = default.group(1).rsplit("/", 1)[-1]
    assert name not in ("", "test", "postgres"), name
    page = QUICKSTART.read_text(encoding="utf-8")
    assert re.search(rf"^createdb .*\b{name}$", page, flags=re.MULTILINE), page
    assert f"CREATE DATABASE {name}" in page


#: what the README's example connects to, and what this run's servers replace it with
README_DATABASE = "postgresql+psycopg://postgres@127.0.0.1:5432/sa_fence_quickstart"
README_REDIS = "sa_fence.Fencer(redis.Redis(socket_timeout=5), engine)"


def test_the_readme_opens_with_its_pitch_the_guarantee_and_a_short_example() -> None:
    text = README.read_text(encoding="utf-8")
    words = text.split()
    assert len(words) <= 750, f"the README has {len(words)} words: move the detail into docs/"
    before_code = text[: text.index("```python")].split()
    assert len(before_code) <= 200, f"the example starts after {len(before_code)} words"
    assert "> **Once a newer lease of a name has been granted" in text  # the guarantee
    for command in ("make demo", "make test"):
        assert command in text, command
    database = README_DATABASE.rsplit("/", 1)[-1]
    assert f"createdb -h 127.0.0.1 -U postgres {database}" in text


def test_the_readme_example_runs_and_prints_what_the_readme_shows(
    redis_client: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    text = README.read_text(encoding="utf-8")
    code = re.search(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)
    shown = re.search(r"^```text\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)
    assert code
    assert shown
    assert code.end() < shown.start()
    # the reader's servers, as the example names them, become this run's
    assert code.group(1).count(README_DATABASE) == 1
    assert code.group(1).count(README_REDIS) == 1
    client = f"redis.Redis.from_url({REDIS_URL!r}, socket_timeout=5)"

    def script(engine: sa.Engine) -> str:
        return (
            code.group(1)
            .replace(README_DATABASE, engine.url.render_as_string(hide_password=False))
            .replace(
                README_REDIS,
                f"sa_fence.Fencer({client}, engine, key_prefix={key_prefix!r})",
            )
        )

    lines = run_script(script, "the README's example", key_prefix, tmp_path)
    assert lines == shown.group(1).strip().splitlines()  # a new database: token 1
    assert list(redis_client.scan_iter(match=f"{key_prefix}*")) == []


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_the_api_reference_generates_an_entry_for_every_public_name() -> None:
    """Signatures come from the code (mkdocstrings), so they cannot drift from it;
    tests/project/test_docs_site.py checks that each entry is generated."""
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    directives = re.findall(r"^::: sa_fence\.(\w+)$", api, flags=re.MULTILINE)
    public = {*sa_fence.__all__, *sa_fence._LAZY}  # _LAZY: public, loaded on first use
    assert sorted(public - set(directives)) == []
    assert [d for d in directives if d not in public] == ["testing"]
    # the public module's names, under their module (sa_fence.telemetry)
    for name in sa_fence.telemetry.__all__:
        assert f"\n::: sa_fence.telemetry.{name}\n" in api, name
    # no hand-written signature to drift: a heading names, the directive signs
    assert not re.search(r"^#+ .*\w\(.*\)", api, flags=re.MULTILINE)


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_the_user_docs_speak_of_the_product_only(page: Path) -> None:
    """No machine paths, no internal sources, no text a user cannot read."""
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"(?<![\w.])/(?:work|root|home|tmp|Users)/", text), "a machine path"
    assert not re.search(r"[\u3040-\u30ff\u4e00-\u9fff]", text), "text outside English"
    assert "shared/" not in text
    assert "seeds" not in text


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_a_page_opens_with_a_summary_a_reader_can_skim(page: Path) -> None:
    """The title, then a short paragraph of prose: no heading, list, table or code first."""
    title, _, rest = page.read_text(encoding="utf-8").partition("\n")
    assert title.startswith("# "), f"{page.name} opens with no title"
    summary = rest.lstrip("\n").split("\n\n", 1)[0]
    assert not re.match(r"(#|```|[-*|>]|\d+\.)", summary), (
        f"{page.name}: a summary paragraph goes right under the title, before {summary[:40]!r}"
    )
    words = len(summary.split())
    assert words <= 90, f"{page.name}: its summary has {words} words; keep it to 2-3 sentences"


def test_snippets_name_only_what_the_quickstart_defines() -> None:
    """Snippets use the quickstart's Job (id, result, fence) and its table jobs."""
    quickstart = guide_block("Quickstart")
    assert '__tablename__ = "jobs"' in quickstart
    for page in pages():
        text = page.read_text(encoding="utf-8")
        assert "Job.status" not in text, page.name
        assert "quickstart_jobs" not in text, page.name


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_a_page_shows_its_code_and_it_is_the_recipe_the_suite_runs(page: Path) -> None:
    """Readable on a repository browser (no include), and one text with docs/recipes/."""
    text = page.read_text(encoding="utf-8")
    assert "--8<--" not in text, f"{page.name}: show the code on the page, not only an include"
    for name, body in re.findall(r'^```python title="([\w.]+)"\n(.*?)^```$', text, re.M | re.S):
        recipe = DOCS / "recipes" / name
        if recipe.exists():
            assert body == recipe.read_text(encoding="utf-8"), (
                f"the {name} block of docs/{page.name} differs from docs/recipes/{name}"
            )


def test_the_flush_update_how_it_works_shows_is_the_statement_a_flush_sends(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """docs/how-it-works.md shows the UPDATE a fenced flush sends; it is that statement, but
    for the parameters' types the page leaves out."""
    page = (DOCS / "how-it-works.md").read_text()
    shown = re.search(r"The flush UPDATE therefore looks like this.*?```sql\n(.*?)```", page, re.S)
    assert shown is not None, "how-it-works.md no longer shows the flush UPDATE"
    seed(fencer, make_session, Job(id=1, result="initial"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.get(Job, 1).result = "done"  # type: ignore[union-attr]
        with recorded_statements(engine) as sent:
            session.flush()
        session.commit()
    updates = [sql for sql in sent if sql.startswith("UPDATE")]
    assert len(updates) == 1, sent

    def normal(sql: str) -> str:  # no parameter types, one space between words
        return " ".join(re.sub(r"::[A-Z]+(\(\d+\))?", "", sql).split())

    assert normal(updates[0]) == normal(shown.group(1))
