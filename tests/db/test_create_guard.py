"""A database made the quickstart way (``create_all``) gets its guard without
Alembic, ``sa-fence check`` calls a missing guard advice, and a fenced model
whose table lacks the fence column fails with a FencingConfigError."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import sa_fence
from sa_fence.cli import check as _check
from sa_fence.cli import main as cli
from sa_fence.orm import statements
from tests._fresh_db import fresh_database, url_of
from tests._sql import PARTITIONED_TABLES
from tests.models import Base, Cell, Job

GUARDED = ("cells", "jobs")


@pytest.fixture
def created() -> Iterator[sa.Engine]:
    """A database made with ``Base.metadata.create_all`` only: no migrations, no guard."""
    with fresh_database("create_all") as engine:
        Base.metadata.create_all(engine)
        yield engine


def run_cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, " ".join(out.split()), " ".join(err.split())


def triggers(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text(
                    "SELECT tgrelid::regclass::text FROM pg_trigger "
                    "WHERE tgname = 'sa_fence_guard' AND NOT tgisinternal"
                )
            ).scalars()
        )


def test_check_calls_a_missing_guard_advice_naming_both_ways_and_strict_makes_it_a_problem(
    created: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_cli("check", "--url", url_of(created), capsys=capsys)
    assert (status, err) == (0, ""), out
    assert "PROBLEM" not in out
    assert "advice table jobs has no enabled guard trigger sa_fence_guard" in out
    assert (
        "fix: sa-fence create-guard --url ... jobs (or in Python: "
        "sa_fence.create_fence_guard(engine, 'jobs')); in an Alembic migration: "
        "op.create_fence_guard('jobs')" in out
    )
    assert "No problems found. 2 piece(s) of advice" in out

    status, out, _ = run_cli("check", "--strict", "--url", url_of(created), capsys=capsys)
    assert status == 1
    assert "PROBLEM table jobs has no enabled guard trigger sa_fence_guard" in out
    assert "2 problem(s) found." in out
    assert "advice" not in out


def test_create_fence_guard_makes_the_guard_sa_fence_check_finds_current(
    created: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    sa_fence.create_fence_guard(created, "jobs")
    sa_fence.create_fence_guard(created, Cell.__table__)  # a Table: its fence column
    sa_fence.create_fence_guard(created, "jobs")  # again: replaces, no error
    assert triggers(created) == set(GUARDED)
    status, out, _ = run_cli("check", "--strict", "--url", url_of(created), capsys=capsys)
    assert status == 0, out
    assert "ok table jobs: column fence, guard sa_fence_guard" in out
    assert "ok table cells: column fence, guard sa_fence_guard" in out
    assert "advice" not in out


def test_the_guard_made_without_alembic_refuses_a_raw_stale_write(created: sa.Engine) -> None:
    with created.begin() as conn:
        sa_fence.create_fence_guard(conn, "jobs")  # in the caller's transaction
        conn.execute(sa.text("SELECT setval('sa_fence_token_seq', 9)"))
        conn.execute(sa.text("INSERT INTO jobs (id, status, fence) VALUES (1, 'new', 9)"))
    with created.connect() as conn:
        conn.execute(sa.text("SELECT set_config('sa_fence.token', '5', true)"))
        with pytest.raises(sa.exc.DBAPIError, match="sa-fence guard: UPDATE on table"):
            conn.execute(sa.text("UPDATE jobs SET result = 'late' WHERE id = 1"))
        conn.rollback()
    with created.connect() as conn:
        assert conn.execute(sa.text("SELECT result FROM jobs")).scalar_one() is None


def test_tables_whose_long_names_share_a_prefix_get_a_guard_each(
    created: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """Past 63 bytes PostgreSQL would cut the guard function's name, so two such tables would
    share one function (the second replacing the first's body).  Long names get a hash."""
    stem = "t" * 40
    tables = [f"{stem}_invoices_2026", f"{stem}_invoices_2027"]
    with created.begin() as conn:
        for table in tables:
            conn.execute(sa.text(f"CREATE TABLE {table} (id int PRIMARY KEY, fence bigint)"))
            sa_fence.create_fence_guard(conn, table)
        conn.execute(sa.text("SELECT setval('sa_fence_token_seq', 9)"))
        for table in tables:
            conn.execute(sa.text(f"INSERT INTO {table} (id, fence) VALUES (1, 9)"))
    with created.connect() as conn:
        functions = conn.execute(
            sa.text("SELECT proname FROM pg_proc WHERE proname LIKE 'sa_fence_guard_t%'")
        ).scalars()
        assert sorted(len(name.encode()) <= 63 for name in functions) == [True, True]
    assert triggers(created) == set(tables)
    for table in tables:
        with created.connect() as conn:
            conn.execute(sa.text("SELECT set_config('sa_fence.token', '5', true)"))
            with pytest.raises(sa.exc.DBAPIError, match=f"UPDATE on table.*{table}"):
                conn.execute(sa.text(f"UPDATE {table} SET fence = 5 WHERE id = 1"))
            conn.rollback()
    _, out, _ = run_cli("check", "--url", url_of(created), capsys=capsys)
    for table in tables:  # current, each (cells and jobs, made by create_all, have none)
        assert f"ok table {table}: column fence, guard sa_fence_guard" in out
    sa_fence.drop_fence_guard(created, tables[0])
    assert triggers(created) == {tables[1]}


@pytest.mark.parametrize(
    ("ddl", "table", "message"),
    [
        (None, "nope", "table 'nope' does not exist; create it first"),
        ("CREATE TABLE bare (id int PRIMARY KEY)", "bare", "table 'bare' has no column 'fence'"),
        (
            "CREATE TABLE texty (id int PRIMARY KEY, fence text)",
            "texty",
            "table 'texty' has a text column 'fence'",
        ),
        (
            "DROP SEQUENCE sa_fence_token_seq CASCADE",
            "jobs",
            "the token sequence 'sa_fence_token_seq' does not exist",
        ),
        (  # no Fencer grants a token from it: refused now, not at the first grant
            "ALTER SEQUENCE sa_fence_token_seq CACHE 20",
            "jobs",
            "token sequence sa_fence_token_seq cannot issue fencing tokens: it has CACHE 20",
        ),
        (
            "ALTER SEQUENCE sa_fence_token_seq AS integer",
            "jobs",
            "its type is integer (need bigint: AS bigint)",
        ),
    ],
)
def test_create_guard_refuses_bad_input_by_name_and_writes_nothing(
    created: sa.Engine,
    capsys: pytest.CaptureFixture[str],
    ddl: str | None,
    table: str,
    message: str,
) -> None:
    if ddl:
        with created.begin() as conn:
            conn.execute(sa.text(ddl))
    with pytest.raises(ValueError, match=re.escape(message)):
        sa_fence.create_fence_guard(created, table)
    # the command: all tables in one transaction, so jobs gets no guard either
    status, _, err = run_cli(
        "create-guard", "--url", url_of(created), "cells", table, capsys=capsys
    )
    assert status == 1
    assert message in err
    assert "Nothing was created." in err
    assert triggers(created) == set()


def test_create_guard_command_guards_each_table(
    created: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_cli("create-guard", "--url", url_of(created), *GUARDED, capsys=capsys)
    assert (status, err) == (0, ""), err
    assert "created guard trigger sa_fence_guard on jobs (column fence" in out
    assert triggers(created) == set(GUARDED)


def test_create_fence_guard_refuses_what_is_not_a_sync_postgresql_bind() -> None:
    with pytest.raises(TypeError, match="Engine or Connection"):
        sa_fence.create_fence_guard("postgresql://x/y", "jobs")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="PostgreSQL trigger, but this Engine is sqlite"):
        sa_fence.create_fence_guard(sa.create_engine("sqlite://"), "jobs")
    plain = sa.Table("plain", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    with pytest.raises(ValueError, match=r"has no fence column: add sa_fence\.fence_column"):
        sa_fence.create_fence_guard(sa.create_engine("postgresql+psycopg://x/y"), plain)


# ------------------------------------------ a fenced model, a table without the column


@pytest.fixture
def no_fence_column(redis_client: redis.Redis, key_prefix: str) -> Iterator[sa.Engine]:
    """``jobs`` made before the model was fenced: create_all leaves it as it is."""
    with fresh_database("nofence") as engine:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "CREATE TABLE jobs (id int PRIMARY KEY, result varchar(200), "
                    "status varchar(20))"
                )
            )
        Base.metadata.create_all(engine)  # the sequence, the register; jobs is kept
        yield engine


def fenced_session(engine: sa.Engine) -> sessionmaker[sa.orm.Session]:
    return sa_fence.install(sessionmaker(engine))


MISSING = (
    r"table jobs has no fence column 'fence' in this database, but the model maps it as "
    r"fenced .* op\.add_fence_column\('jobs'\); without Alembic: ALTER TABLE \"jobs\" ADD "
    r"COLUMN \"fence\" bigint NOT NULL DEFAULT 0; .*sa_fence\.create_fence_guard"
)


def test_a_fenced_model_without_its_column_fails_with_a_config_error_at_the_first_read(
    no_fence_column: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    fencer = sa_fence.Fencer(redis_client, no_fence_column, key_prefix=key_prefix)
    try:
        with fencer.acquire("job:1", ttl=30) as lease, fenced_session(no_fence_column)() as s:
            lease.bind(s)
            with pytest.raises(sa_fence.FencingConfigError, match=MISSING) as caught:
                s.get(Job, 1)
            assert getattr(caught.value.cause, "sqlstate", None) == "42703"  # the driver's
    finally:
        fencer.close()


def test_a_fenced_model_without_its_column_fails_with_a_config_error_at_the_first_flush(
    no_fence_column: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    fencer = sa_fence.Fencer(redis_client, no_fence_column, key_prefix=key_prefix)
    try:
        with fencer.acquire("job:2", ttl=30) as lease, fenced_session(no_fence_column)() as s:
            lease.bind(s)
            s.add(Job(id=2, result="x"))
            with pytest.raises(sa_fence.FencingConfigError, match=MISSING):
                s.flush()
            s.rollback()
    finally:
        fencer.close()
    with no_fence_column.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 0


def test_without_the_translation_the_raw_undefined_column_error_comes_through(
    no_fence_column: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair of the two tests above: the guard removed, the driver error is all there is."""
    monkeypatch.setattr(statements, "_refuse_missing_fence_column", lambda context: None)
    with fenced_session(no_fence_column)() as s, pytest.raises(sa.exc.ProgrammingError) as caught:
        s.get(Job, 1)
    assert not isinstance(caught.value, sa_fence.FencingConfigError)
    assert "column jobs.fence does not exist" in str(caught.value)


@pytest.mark.parametrize("through", ["an alias", "a join with a table that has its fence"])
def test_the_table_without_its_fence_column_is_named_whatever_the_query_calls_it(
    no_fence_column: sa.Engine, through: str
) -> None:
    """PostgreSQL names the relation as the query does: an alias (``jobs_1``) is none of
    the tables, so the statement's own fenced table is named; beside a table that has its
    fence column (cells), the one PostgreSQL names is."""
    alias = sa.orm.aliased(Job)
    query = (
        sa.select(alias)
        if through == "an alias"
        else sa.select(Cell, Job).join(Job, Job.result == Cell.value)
    )
    with fenced_session(no_fence_column)() as s:
        with pytest.raises(sa_fence.FencingConfigError, match=MISSING):
            s.execute(query).all()
        s.rollback()


def test_another_missing_column_is_not_taken_for_the_fence(created: sa.Engine) -> None:
    with created.begin() as conn:
        conn.execute(sa.text("ALTER TABLE jobs DROP COLUMN status"))
    with fenced_session(created)() as s, pytest.raises(sa.exc.ProgrammingError) as caught:
        s.get(Job, 1)
    assert not isinstance(caught.value, sa_fence.FencingConfigError)
    assert "status" in str(caught.value)


def test_check_reports_advice_in_its_report_object(created: sa.Engine) -> None:
    with created.connect() as conn:
        report = _check.check(conn)
    assert sorted(f.subject for f in report.advice) == ["table cells", "table jobs"]
    assert report.findings == []


async def test_asyncio_gets_the_same_config_error_and_can_create_the_guard_with_run_sync(
    no_fence_column: sa.Engine,
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    url = no_fence_column.url.set(drivername="postgresql+psycopg_async")
    async_engine = create_async_engine(url)
    try:
        make = sa_fence.install(async_sessionmaker(async_engine))
        async with make() as session:
            with pytest.raises(sa_fence.FencingConfigError, match=MISSING):
                await session.get(Job, 1)
        with pytest.raises(TypeError, match=r"conn\.run_sync"):
            sa_fence.create_fence_guard(async_engine, "jobs")  # type: ignore[arg-type]
        async with async_engine.begin() as conn:
            await conn.execute(
                sa.text("ALTER TABLE jobs ADD COLUMN fence bigint NOT NULL DEFAULT 0")
            )
            await conn.run_sync(sa_fence.create_fence_guard, "jobs")
    finally:
        await async_engine.dispose()
    assert triggers(no_fence_column) == {"jobs"}


def test_create_guard_on_a_partition_is_refused_naming_its_partitioned_table(
    created: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """A partition's guard is its partitioned table's, cloned onto it by PostgreSQL: a guard
    of its own would fence it alone (before the parent has one), and replacing the clone
    fails with DependentObjectsStillExist.  Refused before anything is written."""
    with created.begin() as conn:
        for ddl in PARTITIONED_TABLES:
            conn.execute(sa.text(ddl))
    refusal = "table 'parted_a' is a partition of parted: guard parted instead"
    with pytest.raises(ValueError, match=re.escape(refusal)):  # the parent has no guard yet
        sa_fence.create_fence_guard(created, "parted_a")
    assert triggers(created) == set()
    sa_fence.create_fence_guard(created, "parted")
    guarded = {"parted", "parted_a", "parted_b", "parted_b1"}  # the parent's, and its clones
    assert triggers(created) == guarded
    with pytest.raises(ValueError, match=re.escape("'parted_b1' is a partition of parted:")):
        sa_fence.create_fence_guard(created, "parted_b1")  # (the root, two levels up)
    status, out, err = run_cli(
        "create-guard", "--url", url_of(created), "cells", "parted_a", capsys=capsys
    )
    assert (status, out) == (1, "")
    assert err == (
        f"sa-fence create-guard: create_fence_guard: {refusal}, whose guard PostgreSQL clones "
        "onto every partition and fires for writes to each. Nothing was created."
    )
    assert triggers(created) == guarded  # cells got none: one transaction


def test_a_table_whose_name_holds_a_colon_word_is_guarded_online_and_offline(
    created: sa.Engine,
) -> None:
    """`` :x`` in a quoted name is legal SQL, and SQLAlchemy's text() reads it as a bind
    parameter: the guard's DDL failed ("a value is required for bind parameter 'x'"), and
    offline SQL carried ``%(x)s`` in its place."""
    import io

    from alembic.migration import MigrationContext
    from alembic.operations import Operations

    import sa_fence.alembic

    with created.begin() as conn:
        conn.exec_driver_sql('CREATE TABLE "job :x" (id int PRIMARY KEY, fence bigint)')
    sa_fence.create_fence_guard(created, "job :x")
    assert triggers(created) == {'"job :x"'}
    out = io.StringIO()
    offline = MigrationContext.configure(
        dialect_name="postgresql", opts={"as_sql": True, "output_buffer": out}
    )
    Operations(offline).create_fence_guard("job :x")
    assert 'ON "job :x"' in out.getvalue()
    assert "%(x)s" not in out.getvalue()
    sa_fence.drop_fence_guard(created, "job :x")
    assert triggers(created) == set()
