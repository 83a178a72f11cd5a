"""``sa-fence check`` and ``sa-fence repair-sequence`` against live databases."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from sa_fence import cli
from sa_fence._schema import upgrade_demo_schema
from tests._fresh_db import fresh_database, url_of


@pytest.fixture
def migrated() -> Iterator[sa.Engine]:
    with fresh_database("check") as engine:
        upgrade_demo_schema(engine)
        yield engine


def sa_fence_cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, " ".join(out.split()), " ".join(err.split())


def restored_behind(engine: sa.Engine) -> None:
    """Rows written with tokens up to 41, then the sequence "restored" to 7."""
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO jobs (id, fence) VALUES (1, 12), (2, 41)"))
        conn.execute(sa.text("INSERT INTO job_steps (job_id, step, fence) VALUES (1, 1, 30)"))
        conn.execute(sa.text("SELECT setval('sa_fence_token_seq', 7)"))


def sequence_last_value(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT last_value FROM sa_fence_token_seq")).scalar_one())


def test_check_passes_on_a_database_built_by_the_migrations(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert (status, err) == (0, ""), out
    assert "ok sequence sa_fence_token_seq: bigint, CACHE 1, NO CYCLE" in out
    assert "ok table jobs: column fence, guard sa_fence_guard" in out
    assert "ok table job_steps: column fence, guard sa_fence_guard" in out
    assert "No problems found." in out


def test_check_reports_a_sequence_set_behind_the_rows_and_repair_moves_it_past(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    restored_behind(migrated)
    url = url_of(migrated)
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 1
    assert (
        "PROBLEM sequence sa_fence_token_seq is behind the rows: its last value is 7 but "
        "max(fence) of job_steps is 30, max(fence) of jobs is 41." in out
    )
    assert "fix: stop the workers, then: sa-fence repair-sequence" in out

    status, out, _ = sa_fence_cli(
        "repair-sequence", "--url", url, "--margin", "100", "--yes", capsys=capsys
    )
    assert status == 0, out
    assert "Moved sa_fence_token_seq to 141; the next token is 142." in out
    assert sequence_last_value(migrated) == 141
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 0, out


def test_repair_sequence_asks_first_and_changes_nothing_when_declined(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    restored_behind(migrated)
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "n")
    status, out, _ = sa_fence_cli("repair-sequence", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert asked == [
        "Move sa_fence_token_seq from 7 to 1041? Stop the workers first. [y/N] "
    ]  # default margin 1000
    assert "Aborted: nothing changed." in out
    assert sequence_last_value(migrated) == 7


def test_repair_sequence_never_moves_the_sequence_backwards(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with migrated.begin() as conn:
        conn.execute(sa.text("INSERT INTO jobs (id, fence) VALUES (1, 12)"))
        conn.execute(sa.text("SELECT setval('sa_fence_token_seq', 5000)"))
    status, out, _ = sa_fence_cli(
        "repair-sequence", "--url", url_of(migrated), "--yes", capsys=capsys
    )
    assert status == 0
    assert "Nothing to do: the sequence is already at or past 1012" in out
    assert sequence_last_value(migrated) == 5000


def test_check_names_a_missing_guard_and_a_cached_sequence_with_their_fixes(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with migrated.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER sa_fence_guard ON job_steps"))
        conn.execute(sa.text("ALTER SEQUENCE sa_fence_token_seq CACHE 20 CYCLE"))
        conn.execute(sa.text("CREATE TABLE legacy (id int PRIMARY KEY, fence bigint)"))
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert "3 problem(s) found." in out
    assert "PROBLEM sequence sa_fence_token_seq it has CACHE 20" in out
    assert "it is CYCLE" in out
    assert 'ALTER SEQUENCE "sa_fence_token_seq" AS bigint CACHE 1 NO CYCLE' in out
    assert "PROBLEM table job_steps has no enabled guard trigger sa_fence_guard" in out
    assert "fix: op.create_fence_guard('job_steps')" in out
    assert "fix: op.create_fence_guard('legacy')" in out


def test_check_with_metadata_finds_a_fenced_model_whose_table_lacks_its_column(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with migrated.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER sa_fence_guard ON jobs"))
        conn.execute(sa.text("ALTER TABLE jobs DROP COLUMN fence"))
    status, out, _ = sa_fence_cli(
        "check", "--url", url_of(migrated), "--metadata", "sa_fence._demo:DemoBase", capsys=capsys
    )
    assert status == 1
    assert "PROBLEM table jobs has no fence column 'fence' fix: op.add_fence_column('jobs')" in out


def test_check_refuses_bad_arguments_and_names_an_unreachable_database(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, _, err = sa_fence_cli("check", "--url", "not a url", capsys=capsys)
    assert status == 2
    assert "is not a SQLAlchemy URL" in err
    status, _, err = sa_fence_cli("check", "--url", "sqlite:///x.db", capsys=capsys)
    assert status == 2
    assert "must name a PostgreSQL database" in err
    status, _, err = sa_fence_cli(
        "check", "--url", "postgresql+psycopg://postgres@127.0.0.1:5432/db", "--metadata",
        "nope", capsys=capsys,
    )  # fmt: skip
    assert status == 2
    assert "--metadata must look like 'package.module:Base.metadata'" in err
    status, _, err = sa_fence_cli(
        "check", "--url", "postgresql+psycopg://postgres@127.0.0.1:1/db", capsys=capsys
    )
    assert status == 3
    assert "cannot connect to postgresql+psycopg://postgres@127.0.0.1:1/db" in err
    with pytest.raises(SystemExit) as usage:
        cli.main(["repair-sequence", "--url", "postgresql://x/y", "--margin", "-5"])
    assert usage.value.code == 2
    assert "must be >= 0" in capsys.readouterr().err
