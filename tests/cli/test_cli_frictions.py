"""The CLI as a new user meets it (issue 12): ``python -m sa_fence``, ``--url``
from the environment, ``--metadata`` from the project folder, ``bench --redis``.
The demo's output is pinned in tests/cli/test_demo.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from sa_fence.cli import main as cli
from sa_fence.cli.schema import upgrade_demo_schema
from tests._fresh_db import fresh_database, url_of

SA_FENCE = Path(sys.executable).parent / "sa-fence"

pytestmark = pytest.mark.slow  # the commands run as a user types them, in subprocesses


def run(
    *argv: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    command: str = "script",
    stdin: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """The command as a user types it, in a subprocess."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SA_FENCE_")}
    program = [str(SA_FENCE)] if command == "script" else [sys.executable, "-m", "sa_fence"]
    return subprocess.run(
        [*program, *argv],
        cwd=cwd,
        env={**base, **(env or {})},
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def migrated() -> Iterator[sa.Engine]:
    with fresh_database("cli") as engine:
        upgrade_demo_schema(engine)
        yield engine


def test_python_dash_m_sa_fence_is_the_sa_fence_command() -> None:
    version = run("--version", command="module")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("sa-fence ")
    usage = run("--help", command="module")
    for command in ("demo", "check", "repair-sequence", "bench"):
        assert command in usage.stdout


@pytest.mark.parametrize("command", ["check", "repair-sequence", "bench"])
def test_help_does_not_mark_url_required_and_names_the_environment_variable(
    command: str,
) -> None:
    text = run(command, "--help").stdout
    assert "[--url URL]" in " ".join(text.split())
    assert "$SA_FENCE_DATABASE_URL; required when it is not set" in " ".join(text.split())


def test_a_missing_url_is_asked_for_naming_the_environment_variable() -> None:
    missing = run("check")
    assert missing.returncode == 2
    assert "--url is required when $SA_FENCE_DATABASE_URL is not set" in missing.stderr


def test_the_environment_variable_is_enough_for_check(migrated: sa.Engine) -> None:
    done = run("check", env={"SA_FENCE_DATABASE_URL": url_of(migrated)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No problems found." in done.stdout


def write_project(root: Path) -> None:
    """A user's project: ``myapp/models.py`` with a fenced model, as the docs show."""
    package = root / "myapp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(
        textwrap.dedent(
            """
            from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

            import sa_fence


            class Base(DeclarativeBase):
                pass


            sa_fence.fence_schema(Base.metadata)


            class Job(sa_fence.Fenced, Base):
                __tablename__ = "jobs"
                id: Mapped[int] = mapped_column(primary_key=True)
            """
        )
    )


def test_metadata_is_imported_from_the_current_folder_as_alembic_does(
    migrated: sa.Engine, tmp_path: Path
) -> None:
    write_project(tmp_path)
    done = run("check", "--url", url_of(migrated), "--metadata", "myapp.models:Base", cwd=tmp_path)
    assert "No module named" not in done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok table jobs" in " ".join(done.stdout.split())


def test_app_dir_names_the_folder_to_import_from(migrated: sa.Engine, tmp_path: Path) -> None:
    write_project(tmp_path / "project")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ("check", "--url", url_of(migrated), "--metadata", "myapp.models:Base")
    done = run(*args, "--app-dir", str(tmp_path / "project"), cwd=elsewhere)
    assert done.returncode == 0, done.stdout + done.stderr
    lost = run(*args, cwd=elsewhere)
    assert lost.returncode == 2
    message = " ".join(lost.stderr.split())
    assert f"no module 'myapp' in {elsewhere}" in message
    assert "--app-dir" in message
    assert "PYTHONPATH" in message


def test_a_module_that_fails_inside_is_reported_as_such(
    migrated: sa.Engine, tmp_path: Path
) -> None:
    (tmp_path / "broken.py").write_text("import not_installed_anywhere\n")
    done = run(
        "check", "--url", url_of(migrated), "--metadata", "broken:Base", cwd=tmp_path
    )  # fmt: skip
    assert done.returncode == 2
    assert "importing 'broken' failed" in done.stderr
    assert "not_installed_anywhere" in done.stderr


def test_bench_redis_defaults_to_its_own_variable_not_the_demos(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = "postgresql+psycopg://u@127.0.0.1:5432/db"
    monkeypatch.setenv("SA_FENCE_DEMO_REDIS", "redis://127.0.0.1:1/9")
    monkeypatch.delenv("SA_FENCE_REDIS_URL", raising=False)
    args = cli.build_parser().parse_args(["bench", "--url", url])
    assert args.redis == cli.DEFAULT_REDIS
    monkeypatch.setenv("SA_FENCE_REDIS_URL", "redis://127.0.0.1:6379/3")
    args = cli.build_parser().parse_args(["bench", "--url", url])
    assert args.redis == "redis://127.0.0.1:6379/3"


def test_repair_sequence_without_yes_and_without_stdin_answers_no_without_a_traceback() -> None:
    """A script or CI job that forgot --yes: input() meets the end of input."""
    with fresh_database("cli_eof") as engine:
        upgrade_demo_schema(engine)
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT setval('sa_fence_token_seq', 5000)"))
            conn.execute(sa.text("INSERT INTO jobs (id, fence) VALUES (1, 5000)"))
            conn.execute(sa.text("SELECT setval('sa_fence_token_seq', 7)"))  # "restored"
        done = run("repair-sequence", "--url", url_of(engine), stdin=subprocess.DEVNULL)
        with engine.connect() as conn:
            last = conn.execute(sa.text("SELECT last_value FROM sa_fence_token_seq")).scalar()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "Aborted: no answer (end of input); nothing changed." in done.stdout
    assert last == 7
