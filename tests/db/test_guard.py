"""The database-side guard on real PostgreSQL: raw SQL, Core and ORM writers alike.

The schema comes from the repository's migrations/ (``alembic upgrade
head``): ``jobs`` has a guard with ``on_missing_token="unchanged"``,
``job_steps`` one with the default ``"reject"``.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.cli.demo_models import DemoJob, DemoStep
from sa_fence.cli.schema import upgrade_demo_schema
from sa_fence.db import guard as _guard
from sa_fence.db import tokens as _tokens
from sa_fence.orm import rewrite as _rewrite
from tests._fresh_db import fresh_database
from tests._sql import recorded_statements

#: The token sequence's last value when the module starts: the raw-SQL tests
#: present tokens at or below it ("issued"); a guard refuses any larger one.
ISSUED = 100
BIGINT_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def guarded() -> Iterator[sa.Engine]:
    with fresh_database("guard") as engine:
        upgrade_demo_schema(engine)
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT setval('sa_fence_token_seq', :v)"), {"v": ISSUED})
        yield engine


@pytest.fixture(autouse=True)
def _empty_tables(guarded: sa.Engine) -> Iterator[None]:
    yield
    with guarded.begin() as conn:
        conn.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
        conn.execute(sa.text("TRUNCATE jobs, job_steps"))  # no row triggers


@pytest.fixture
def fencer(guarded: sa.Engine, redis_client: redis.Redis, key_prefix: str) -> sa_fence.Fencer:
    return sa_fence.Fencer(redis_client, guarded, key_prefix=key_prefix)


@pytest.fixture
def make_session(guarded: sa.Engine) -> sessionmaker[Session]:
    return sa_fence.install(sessionmaker(guarded))


def psql(engine: sa.Engine) -> psycopg.Connection[Any]:
    """A plain driver connection: what a psql session or another service does."""
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    return psycopg.connect(url, autocommit=True)


def insert_rows(engine: sa.Engine, fence: int) -> None:
    """Job 1 and its step as the holder of token ``fence`` wrote them (a raw
    INSERT presenting its fence as its token).  A token the sequence has not
    handed out yet is handed out first, as the grant of a newer lease would:
    the guard refuses a fence past the last token issued, INSERTs included."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "SELECT setval('sa_fence_token_seq', :f) "
                "WHERE :f > (SELECT last_value FROM sa_fence_token_seq)"
            ),
            {"f": fence},
        )
        conn.execute(
            sa.text("INSERT INTO jobs (id, result, fence) VALUES (1, 'B', :f)"), {"f": fence}
        )
        conn.execute(
            sa.text("INSERT INTO job_steps (job_id, step, output, fence) VALUES (1, 2, 'B', :f)"),
            {"f": fence},
        )


def jobs_with_id(engine: sa.Engine, job_id: int) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT result, fence FROM jobs WHERE id = :i"), {"i": job_id})
        return [tuple(r) for r in rows]


def job_row(engine: sa.Engine) -> tuple[Any, ...]:
    (row,) = jobs_with_id(engine, 1)
    return row


STALE_UPDATE = (
    "BEGIN; SELECT set_config('sa_fence.token', '3', true); "
    "UPDATE job_steps SET output = 'A' WHERE job_id = 1 AND step = 2"
)


def run_script(conn: psycopg.Connection[Any], script: str) -> None:
    try:
        for statement in script.split(";"):
            if statement.strip():
                conn.execute(statement)  # type: ignore[arg-type]
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def recreate_guard(engine: sa.Engine, table: str = "job_steps", **kw: Any) -> None:
    with psql(engine) as conn:
        for statement in _guard.create_guard_sql(table, **kw):
            conn.execute(statement)  # type: ignore[arg-type]


def refusal(engine: sa.Engine, script: str) -> psycopg.Error:
    with psql(engine) as conn, pytest.raises(psycopg.Error) as refused:
        run_script(conn, script)
    return refused.value


# ------------------------------------------------------------------ raw SQL


def test_a_raw_sql_write_with_a_stale_token_is_refused_naming_table_key_and_token(
    guarded: sa.Engine,
) -> None:
    insert_rows(guarded, fence=5)
    with psql(guarded) as conn:
        with pytest.raises(psycopg.Error) as refused:
            run_script(conn, STALE_UPDATE)
        row = conn.execute("SELECT output, fence FROM job_steps").fetchone()
    assert refused.value.sqlstate == _guard.STALE_SQLSTATE
    message = str(refused.value)
    assert "table public.job_steps refused for row (job_id, step)=(1, 2)" in message
    assert "token 3 is stale: the row's fence is 5" in message
    assert row == ("B", 5)


def test_without_the_triggers_comparison_the_raw_stale_write_goes_through(
    guarded: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair of the test above: the same write, with the guard's comparison removed."""
    insert_rows(guarded, fence=5)
    monkeypatch.setattr(_guard, "STALE_CHECK", "false")
    try:
        recreate_guard(guarded)
        with psql(guarded) as conn:
            run_script(conn, STALE_UPDATE)  # accepted: the bug the guard exists to stop
            row = conn.execute("SELECT output FROM job_steps").fetchone()
        assert row == ("A",)
    finally:
        monkeypatch.undo()
        recreate_guard(guarded)


def test_an_update_that_lowers_the_fence_is_refused_even_without_a_token(
    guarded: sa.Engine,
) -> None:
    insert_rows(guarded, fence=5)
    with psql(guarded) as conn, pytest.raises(psycopg.Error) as refused:
        run_script(conn, "UPDATE jobs SET result = 'x', fence = 2 WHERE id = 1")
    assert refused.value.sqlstate == _guard.STALE_SQLSTATE
    assert "would lower the fence from 5 to 2" in str(refused.value)
    assert job_row(guarded) == ("B", 5)


def test_a_raw_write_with_a_current_token_is_accepted_and_recorded_on_the_row(
    guarded: sa.Engine,
) -> None:
    insert_rows(guarded, fence=5)
    with psql(guarded) as conn:
        run_script(
            conn,
            "BEGIN; SELECT set_config('sa_fence.token', '7', true); "
            "UPDATE jobs SET result = 'C' WHERE id = 1",
        )
        run_script(
            conn,  # the same token again: <=, not <
            "BEGIN; SELECT set_config('sa_fence.token', '7', true); "
            "UPDATE jobs SET result = 'D' WHERE id = 1",
        )
    assert job_row(guarded) == ("D", 7)


def test_a_writer_presenting_no_token_is_refused_by_a_reject_guard(guarded: sa.Engine) -> None:
    insert_rows(guarded, fence=5)
    with psql(guarded) as conn, pytest.raises(psycopg.Error) as refused:
        run_script(conn, "UPDATE job_steps SET output = 'x'")
    assert refused.value.sqlstate == _guard.NO_TOKEN_SQLSTATE
    assert "presents no token" in str(refused.value)
    assert "set_config('sa_fence.token'" in (refused.value.diag.message_hint or "")


@pytest.mark.parametrize("presented", ["3x", "-3", " 3", "12345678901234567890"])
def test_a_setting_that_is_not_a_token_is_refused_with_the_fix(
    guarded: sa.Engine, presented: str
) -> None:
    """What a writer presents is read as a token only when it is one (digits, at most
    19 of them): anything else is a no-token refusal that shows the value and says how
    to present a token, never a cast error (or a bigint overflow) from inside the guard."""
    insert_rows(guarded, fence=5)
    script = f"BEGIN; SELECT set_config('sa_fence.token', '{presented}', true); " + (
        "UPDATE job_steps SET output = 'x'"
    )
    with psql(guarded) as conn, pytest.raises(psycopg.Error) as refused:
        run_script(conn, script)
    assert refused.value.sqlstate == _guard.NO_TOKEN_SQLSTATE
    assert f"sa_fence.token = {presented} is not a token" in str(refused.value)
    assert "set_config('sa_fence.token', '<token>', true)" in (
        refused.value.diag.message_hint or ""
    )


def test_an_unchanged_guard_lets_a_tokenless_update_through_but_not_a_delete(
    guarded: sa.Engine,
) -> None:
    insert_rows(guarded, fence=5)
    with psql(guarded) as conn:
        run_script(conn, "UPDATE jobs SET result = 'legacy writer' WHERE id = 1")
        with pytest.raises(psycopg.Error) as refused:
            run_script(conn, "DELETE FROM jobs WHERE id = 1")
    assert refused.value.sqlstate == _guard.NO_TOKEN_SQLSTATE
    assert job_row(guarded) == ("legacy writer", 5)


def test_a_connection_sa_fence_never_attached_to_sees_the_raw_error(guarded: sa.Engine) -> None:
    """The SQLSTATE mapping is not engine-wide: plain connections get the driver's error."""
    insert_rows(guarded, fence=5)
    with guarded.connect() as conn, pytest.raises(sa.exc.DatabaseError) as refused:
        conn.execute(sa.text("DELETE FROM jobs WHERE id = 1"))
    assert not isinstance(refused.value, sa_fence.FenceError)
    assert refused.value.orig.sqlstate == _guard.NO_TOKEN_SQLSTATE  # type: ignore[union-attr]


# ------------------------------------------------- tokens no lease was granted


def test_a_guard_refuses_a_raw_writer_that_raises_the_fence_past_any_issued_token(
    guarded: sa.Engine,
) -> None:
    insert_rows(guarded, fence=5)
    for table, where in (("jobs", "id = 1"), ("job_steps", "job_id = 1")):  # both policies
        refused = refusal(guarded, f"UPDATE {table} SET fence = {BIGINT_MAX} WHERE {where}")
        assert refused.sqlstate == _guard.STALE_SQLSTATE
        assert (
            f"the new fence {BIGINT_MAX} is past the last token issued "
            f'({ISSUED} by sequence "sa_fence_token_seq")' in str(refused)
        )
    assert job_row(guarded) == ("B", 5)
    with psql(guarded) as conn:  # a fence up to the last issued token is a token: accepted
        run_script(conn, f"UPDATE jobs SET result = 'C', fence = {ISSUED} WHERE id = 1")
    assert job_row(guarded) == ("C", ISSUED)


def test_a_temporary_sequence_named_as_the_token_sequence_does_not_stand_in_for_it(
    guarded: sa.Engine,
) -> None:
    """pg_temp comes first on a search path: any role may make a temporary sequence of the
    token sequence's name, set it past any token, and have the guard read it instead."""
    insert_rows(guarded, fence=5)
    shadow = (
        "CREATE TEMP SEQUENCE sa_fence_token_seq;"
        f"SELECT setval('pg_temp.sa_fence_token_seq', {BIGINT_MAX});"
    )
    for table, where in (("jobs", "id = 1"), ("job_steps", "job_id = 1")):  # both policies
        refused = refusal(
            guarded, f"{shadow} UPDATE {table} SET fence = {BIGINT_MAX} WHERE {where}"
        )
        assert refused.sqlstate == _guard.STALE_SQLSTATE
        assert "is shadowed by a temporary sequence of this session" in str(refused)
    assert job_row(guarded) == ("B", 5)
    with psql(guarded) as conn:  # a temporary sequence the search path puts last is not read
        run_script(
            conn,
            f"SET search_path = public, pg_temp; {shadow} "
            f"UPDATE jobs SET result = 'C', fence = {ISSUED - 1} WHERE id = 1",
        )
    assert job_row(guarded) == ("C", ISSUED - 1)
    with psql(guarded) as conn:  # the same session, its temporary sequence dropped
        run_script(conn, f"{shadow} DROP SEQUENCE pg_temp.sa_fence_token_seq;")
        run_script(conn, f"UPDATE jobs SET result = 'D', fence = {ISSUED} WHERE id = 1")
    assert job_row(guarded) == ("D", ISSUED)


def test_without_the_issued_check_a_raw_writer_locks_every_later_holder_out(
    guarded: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair of the test above: the guard without its comparison with the sequence."""
    insert_rows(guarded, fence=5)
    monkeypatch.setattr(_guard, "ISSUED_CHECK", "false")
    try:
        recreate_guard(guarded)
        with psql(guarded) as conn:
            run_script(conn, f"UPDATE job_steps SET fence = {BIGINT_MAX}")  # accepted: the hole
            with pytest.raises(psycopg.Error, match="is stale"):  # a real holder, for good
                run_script(conn, STALE_UPDATE.replace("'3'", f"'{ISSUED}'"))
    finally:
        monkeypatch.undo()
        recreate_guard(guarded)


def test_a_guard_refuses_a_presented_token_larger_than_any_issued_token(
    guarded: sa.Engine,
) -> None:
    insert_rows(guarded, fence=5)
    present = "BEGIN; SELECT set_config('sa_fence.token', '{token}', true); "
    for statement in ("UPDATE job_steps SET output = 'A'", "DELETE FROM job_steps"):
        refused = refusal(guarded, present.format(token=ISSUED + 1) + statement)
        assert refused.sqlstate == _guard.STALE_SQLSTATE
        assert f"token {ISSUED + 1} is past the last token issued ({ISSUED}" in str(refused)
    refused = refusal(  # a current token cannot carry a fence past the sequence either
        guarded, present.format(token=ISSUED) + f"UPDATE job_steps SET fence = {ISSUED + 1}"
    )
    assert f"the new fence {ISSUED + 1} is past the last token issued" in str(refused)
    with psql(guarded) as conn:
        run_script(conn, present.format(token=ISSUED) + "UPDATE job_steps SET output = 'A'")
        row = conn.execute("SELECT output, fence FROM job_steps").fetchone()
    assert row == ("A", ISSUED)


def test_the_guard_reads_the_sequence_only_for_a_write_that_raises_the_fence(
    guarded: sa.Engine, role: str
) -> None:
    """A role that may not read the sequence: refused loudly when it would raise a fence,
    untouched when it writes with the row's own token (no sequence read on that path)."""
    insert_rows(guarded, fence=5)
    with guarded.begin() as conn:
        conn.execute(sa.text(f'GRANT SELECT, UPDATE ON jobs TO "{role}"'))
    url = guarded.url.set(drivername="postgresql", username=role)
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as conn:
        run_script(conn, "BEGIN; SELECT set_config('sa_fence.token', '5', true); "
                         "UPDATE jobs SET result = 'same holder'")  # fmt: skip
        with pytest.raises(psycopg.Error) as refused:
            run_script(conn, "BEGIN; SELECT set_config('sa_fence.token', '6', true); "
                             "UPDATE jobs SET result = 'newer holder'")  # fmt: skip
    assert refused.value.sqlstate == "42501"
    assert "sa_fence_token_seq" in str(refused.value)
    assert job_row(guarded) == ("same holder", 5)


@pytest.fixture
def role(guarded: sa.Engine) -> Iterator[str]:
    """A login role with no rights on the token sequence (dropped afterwards)."""
    name = f"sa_fence_test_{uuid.uuid4().hex[:10]}"
    with guarded.begin() as conn:
        conn.execute(sa.text(f'CREATE ROLE "{name}" LOGIN'))
    try:
        yield name
    finally:
        with guarded.begin() as conn:
            conn.execute(sa.text(f'DROP OWNED BY "{name}"'))
            conn.execute(sa.text(f'DROP ROLE "{name}"'))


def test_a_guard_names_the_sequence_it_reads_and_refuses_a_name_that_breaks_its_body() -> None:
    body = _guard.create_guard_sql("jobs", sequence="app.tokens")[0]
    assert 'pg_sequence_last_value(E\'"app"."tokens"\'::regclass)' in body
    assert _guard.DEFAULT_SEQUENCE == _tokens.DEFAULT_SEQUENCE
    with pytest.raises(ValueError, match="cannot contain"):
        _guard.create_guard_sql("jobs", sequence="x$sa_fence$y")
    for empty in (
        {"table": ""},
        {"table": "jobs", "column": ""},
        {"table": "jobs", "sequence": ""},
    ):
        with pytest.raises(ValueError, match="must be a non-empty string, got ''"):
            _guard.create_guard_sql(**empty)


def guard_functions(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(
            conn.execute(
                sa.text("SELECT proname FROM pg_proc WHERE proname LIKE 'sa\\_fence\\_guard%'")
            ).scalars()
        )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"table": "jobs\n); DROP TABLE jobs; --"}, "control character"),  # out of the comment
        ({"table": "jobs", "column": "fe\x00nce"}, "control character"),
        ({"table": "j" * 64}, "at most 63 bytes"),  # PostgreSQL would cut it to another name
        ({"table": "jobs", "schema": "s" * 64}, "at most 63 bytes"),
        ({"table": "jobs", "schema": 123}, "schema must be a non-empty string, got 123"),
        ({"table": "jobs", "sequence": "app." + "t" * 64}, "at most 63 bytes"),
        ({"table": "jobs", "sequence": "tok\rens"}, "control character"),
    ],
)
def test_a_name_the_guard_cannot_carry_is_refused_before_anything_is_sent(
    guarded: sa.Engine, args: dict[str, Any], named: str
) -> None:
    """Names go into the guard's DDL and its body's header comment: a newline would end the
    comment and run the rest as code, and PostgreSQL cuts a name past 63 bytes and goes on
    (a guard on another table, under another function's name).  Refused, nothing created."""
    before = guard_functions(guarded)
    with pytest.raises(ValueError, match=named):
        sa_fence.create_fence_guard(guarded, **args)
    with pytest.raises(ValueError, match=named):
        _guard.create_guard_sql(**args)
    if not {"sequence", "column"} & set(args):  # (drop names the table and schema only)
        with pytest.raises(ValueError, match=named):
            sa_fence.drop_fence_guard(guarded, **args)
    assert guard_functions(guarded) == before


@pytest.mark.parametrize(
    ("made_with", "read_with"),
    [
        ({}, {"schema": "public"}),  # made unqualified, the table declared in public
        ({"schema": "public"}, {"schema": None}),  # made qualified, declared without
        ({"sequence": "public.sa_fence_token_seq"}, {"schema": None}),  # the same, qualified
        ({"on_missing_token": "unchanged"}, {"schema": None}),
    ],
)
def test_a_guard_made_by_this_sa_fence_is_current_however_its_names_were_given(
    made_with: dict[str, Any], read_with: dict[str, Any]
) -> None:
    """``outdated`` (autogenerate's and ``sa-fence check``'s test) compares the source with
    what this sa-fence makes for the same table, with the schema named as given, not at
    all, or as the default schema, with the policy the header names, and reading the
    Fencers' sequence however qualified (another sequence: tests/integrations/test_alembic.py)."""
    source = _guard.function_source(_guard.create_guard_sql("jobs", **made_with))
    reasons = _guard.outdated(
        source,
        True,
        "jobs",
        "fence",
        default_schema="public",
        sequence=_guard.DEFAULT_SEQUENCE,
        **read_with,
    )
    assert reasons == []
    edited = source.replace("RETURN OLD;", "RETURN NULL;")
    assert _guard.outdated(
        edited,
        True,
        "jobs",
        "fence",
        default_schema="public",
        sequence="sa_fence_token_seq",
        **read_with,
    ) == ["its function differs (made by another sa-fence version, or edited by hand)"]


# ----------------------------------------------------------- never fenced rows


@pytest.fixture
def legacy(guarded: sa.Engine) -> Iterator[str]:
    """A guarded table whose fence column allows NULL ("never fenced" rows)."""
    with guarded.begin() as conn:
        conn.execute(sa.text("CREATE TABLE legacy (id int PRIMARY KEY, note text, fence bigint)"))
        conn.execute(sa.text("INSERT INTO legacy VALUES (1, 'old', NULL), (2, 'old', 5)"))
    recreate_guard(guarded, "legacy", on_missing_token="unchanged")
    yield "legacy"
    with guarded.begin() as conn:
        conn.execute(sa.text("DROP TABLE legacy"))
        for statement in _guard.drop_guard_sql("legacy"):
            conn.execute(sa.text(statement))


def legacy_rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT * FROM legacy ORDER BY id"))]


def test_an_update_leaving_a_never_fenced_null_fence_null_is_not_lowering(
    guarded: sa.Engine, legacy: str
) -> None:
    with psql(guarded) as conn:
        run_script(conn, "UPDATE legacy SET note = 'legacy writer' WHERE id = 1")
    assert legacy_rows(guarded)[0] == (1, "legacy writer", None)
    refused = refusal(guarded, "UPDATE legacy SET fence = NULL WHERE id = 2")
    assert refused.sqlstate == _guard.STALE_SQLSTATE
    assert "would lower the fence from 5 to NULL" in str(refused)


def test_a_tokenless_insert_of_a_never_fenced_row_is_let_in_under_either_policy(
    guarded: sa.Engine, legacy: str
) -> None:
    """A row inserted with a NULL fence and no token has no holder to lose to and no
    fence to forge: let in as it is, by a "reject" guard too (writers that know
    nothing of sa-fence keep adding rows; the first fenced write sets the fence)."""
    with psql(guarded) as conn:
        run_script(conn, "INSERT INTO legacy VALUES (3, 'new', NULL)")
        recreate_guard(guarded, "legacy", on_missing_token="reject")
        run_script(conn, "INSERT INTO legacy VALUES (4, 'new', NULL)")
    assert legacy_rows(guarded)[2:] == [(3, "new", None), (4, "new", None)]


def test_a_token_write_to_a_never_fenced_row_records_its_token(
    guarded: sa.Engine, legacy: str
) -> None:
    with psql(guarded) as conn:
        run_script(conn, "BEGIN; SELECT set_config('sa_fence.token', '7', true); "
                         "UPDATE legacy SET note = 'fenced' WHERE id = 1")  # fmt: skip
    assert legacy_rows(guarded)[0] == (1, "fenced", 7)
    refused = refusal(guarded, STALE_UPDATE.replace("job_steps SET output", "legacy SET note")
                      .replace("WHERE job_id = 1 AND step = 2", "WHERE id = 1"))  # fmt: skip
    assert "token 3 is stale: the row's fence is 7" in str(refused)


def test_a_tokenless_writer_cannot_raise_a_never_fenced_row_past_any_issued_token(
    guarded: sa.Engine, legacy: str
) -> None:
    refused = refusal(guarded, f"UPDATE legacy SET fence = {BIGINT_MAX} WHERE id = 1")
    assert refused.sqlstate == _guard.STALE_SQLSTATE
    assert "is past the last token issued" in str(refused)
    with psql(guarded) as conn:  # an issued token as the first fence: accepted
        run_script(conn, f"UPDATE legacy SET fence = {ISSUED} WHERE id = 1")
    assert legacy_rows(guarded)[0] == (1, "old", ISSUED)


# ---------------------------------------------------------------------- Core


def test_core_raw_sql_through_fence_connection_raises_stale_token_error(
    guarded: sa.Engine, fencer: sa_fence.Fencer
) -> None:
    with fencer.acquire("job:1", 5) as lease:
        insert_rows(guarded, fence=lease.token + 10)
        with guarded.connect() as conn, sa_fence.fence_connection(conn, lease):
            with pytest.raises(sa_fence.StaleTokenError) as refused:
                conn.execute(sa.text("UPDATE jobs SET result = 'A' WHERE id = 1"))
            conn.rollback()
    assert refused.value.table == "jobs"
    assert refused.value.primary_keys == ((1,),)
    assert refused.value.token == lease.token
    assert refused.value.current_fences == (lease.token + 10,)
    assert refused.value.lease_name == "job:1"
    assert job_row(guarded) == ("B", lease.token + 10)


def test_core_raw_sql_through_fence_connection_with_a_current_token_writes(
    guarded: sa.Engine, fencer: sa_fence.Fencer
) -> None:
    insert_rows(guarded, fence=0)
    with (
        fencer.acquire("job:1", 5) as lease,
        guarded.connect() as conn,
        sa_fence.fence_connection(conn, lease),
    ):
        conn.execute(sa.text("UPDATE job_steps SET output = 'A'"))
        conn.commit()
        conn.execute(sa.text("UPDATE job_steps SET output = 'A2'"))  # next transaction
        conn.commit()
    with guarded.connect() as conn:
        assert tuple(conn.execute(sa.text("SELECT output, fence FROM job_steps")).one()) == (
            "A2",
            lease.token,
        )


def test_fence_connection_refuses_a_released_lease_and_a_session(
    guarded: sa.Engine, fencer: sa_fence.Fencer
) -> None:
    lease = fencer.acquire("job:1", 5)
    lease.release()
    with guarded.connect() as conn:
        with (
            pytest.raises(sa_fence.LeaseLostError, match="released"),
            sa_fence.fence_connection(conn, lease),
        ):
            pass
        with (
            pytest.raises(TypeError, match=r"lease\.bind\(session\)"),
            sa_fence.fence_connection(Session(guarded), lease),  # type: ignore[arg-type]
        ):
            pass


# ----------------------------------------------------------------------- ORM


@pytest.fixture
def statements(guarded: sa.Engine) -> Iterator[list[str]]:
    """Every SQL statement the guarded database gets while the test runs."""
    with recorded_statements(guarded) as sent:
        yield sent


def test_orm_writes_to_a_reject_guarded_table_present_the_token_inside_their_statements(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], statements: list[str]
) -> None:
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add_all([DemoStep(job_id=1, step=n, output="new") for n in range(3)])
        session.commit()
        for step in session.scalars(sa.select(DemoStep)).all():
            step.output = "again"  # same holder, same token: fence unchanged
        session.commit()
        del statements[:]
        session.delete(session.get(DemoStep, (1, 0)))
        session.commit()
    assert not [s for s in statements if s.lstrip().upper().startswith("SELECT SET_CONFIG")]
    assert any(s.startswith("DELETE FROM job_steps") and "set_config" in s for s in statements)


def test_without_the_token_in_the_statement_the_guard_refuses_the_orm_delete(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above: a bare ``fence <= :token`` presents nothing to the guard."""
    monkeypatch.setattr(_rewrite, "fence_predicate", lambda col, token: col <= token)
    monkeypatch.setattr(_rewrite, "_rewritten", weakref.WeakKeyDictionary())  # built anew
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(DemoStep(job_id=1, step=0, output="new"))
        session.commit()
        session.delete(session.get(DemoStep, (1, 0)))
        with pytest.raises(sa_fence.UnfencedWriteError, match="presents no token"):
            session.commit()


def test_raw_sql_through_a_bound_session_is_fenced_by_the_guard_and_poisons_the_session(
    guarded: sa.Engine, fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    with fencer.acquire("job:1", 5) as lease:
        insert_rows(guarded, fence=lease.token + 1)
        with make_session() as session:
            lease.bind(session)
            with pytest.raises(sa_fence.StaleTokenError) as refused:
                session.execute(sa.text("UPDATE jobs SET result = 'A' WHERE id = 1"))
            with pytest.raises(sa_fence.FenceError, match="rollback"):
                session.commit()
            session.rollback()
    assert refused.value.token == lease.token
    assert job_row(guarded) == ("B", lease.token + 1)


def test_a_bound_session_presents_its_token_once_per_transaction_for_raw_sql(
    guarded: sa.Engine,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    statements: list[str],
) -> None:
    insert_rows(guarded, fence=0)
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        del statements[:]
        session.execute(sa.text("UPDATE job_steps SET output = 'a'"))
        session.execute(sa.text("UPDATE job_steps SET output = 'b'"))
        session.commit()
    presented = [s for s in statements if "set_config" in s]
    assert len(presented) == 1
    with guarded.connect() as conn:
        assert conn.execute(sa.text("SELECT fence FROM job_steps")).scalar_one() == lease.token


def test_a_token_presented_inside_a_savepoint_rolled_back_is_presented_again(
    guarded: sa.Engine, fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """set_config(..., true) inside a savepoint is undone by its ROLLBACK TO: the current
    holder's next raw write presented nothing and the guard refused it."""
    insert_rows(guarded, fence=0)
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        with session.begin_nested() as savepoint:
            session.execute(sa.text("UPDATE jobs SET result = 'undone' WHERE id = 1"))
            savepoint.rollback()
        session.execute(sa.text("UPDATE jobs SET result = 'A' WHERE id = 1"))
        session.commit()
    assert job_row(guarded) == ("A", lease.token)


def test_raw_sql_after_another_lease_wrote_in_the_transaction_presents_its_own_token(
    guarded: sa.Engine, fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """Lease b, bound in between (a nested call on another name), presented its token inside
    its own statement; lease a, bound again, counted its own as still presented, and its next
    raw write was compared with (and stamped with) b's token."""
    insert_rows(guarded, fence=0)
    with (
        fencer.acquire("job:a", 5) as a,
        fencer.acquire("job:b", 5) as b,
        make_session() as session,
    ):
        a.bind(session)
        session.execute(sa.text("UPDATE job_steps SET output = 'a1'"))
        b.bind(session)
        session.get_one(DemoJob, 1).result = "b"
        session.flush()  # presents b's token inside its UPDATE's comparison
        a.bind(session)
        session.execute(sa.text("UPDATE job_steps SET output = 'a2'"))
        session.commit()
    with guarded.connect() as conn:
        assert conn.execute(sa.text("SELECT fence FROM job_steps")).scalar_one() == a.token


def test_raw_sql_given_its_columns_presents_the_token_as_text_does(
    guarded: sa.Engine, fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """text(...).columns(...) (a TextualSelect, for UPDATE ... RETURNING) is raw SQL too."""
    insert_rows(guarded, fence=0)
    returning = sa.text("UPDATE jobs SET result = 'A' WHERE id = 1 RETURNING id")
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        assert session.scalars(returning.columns(sa.column("id", sa.Integer))).all() == [1]
        session.commit()
    assert job_row(guarded) == ("A", lease.token)


def test_the_fenced_flush_sends_no_extra_statement_to_present_its_token(
    guarded: sa.Engine,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    statements: list[str],
) -> None:
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(DemoJob(id=1, result="x"))
        session.commit()
        job = session.get_one(DemoJob, 1)
        assert job.result == "x"  # loaded again after the commit expired it
        del statements[:]
        job.result = "y"
        session.commit()
    assert [s.split()[0] for s in statements] == ["UPDATE"]
    assert job_row(guarded) == ("y", lease.token)


def test_core_dml_inside_fence_connection_is_token_compared_like_a_session(
    guarded: sa.Engine, fencer: sa_fence.Fencer
) -> None:
    jobs = DemoJob.__table__
    with fencer.acquire("job:1", 5) as lease:
        insert_rows(guarded, fence=lease.token + 1)  # a newer holder wrote job 1
        with guarded.connect() as conn, sa_fence.fence_connection(conn, lease):
            conn.execute(jobs.insert().values(id=2, result="A"))
            skipped = conn.execute(jobs.update().values(result="A"))
            assert skipped.rowcount == 1  # only job 2: job 1 is newer
            with pytest.raises(sa_fence.StaleTokenError) as refused:
                conn.execute(
                    jobs.update().where(jobs.c.id == sa.bindparam("jobs_id")),
                    [{"jobs_id": 1, "result": "A"}],
                )
            conn.rollback()
    assert refused.value.primary_keys == ((1,),)
    assert job_row(guarded) == ("B", lease.token + 1)


def test_a_raw_writer_presenting_a_token_records_that_token_not_a_fence_it_chose(
    guarded: sa.Engine,
) -> None:
    """A fence above the writer's own token would shut out later holders of other names."""
    insert_rows(guarded, fence=5)
    with psql(guarded) as conn:
        run_script(
            conn,
            "BEGIN; SELECT set_config('sa_fence.token', '7', true); "
            f"UPDATE jobs SET result = 'C', fence = {ISSUED} WHERE id = 1",
        )
    assert job_row(guarded) == ("C", 7)


# ------------------------------------------------------------------ INSERT


def test_a_raw_insert_of_a_fence_past_any_issued_token_is_refused(guarded: sa.Engine) -> None:
    """A forged fence on a new row would lock every later holder out of it for
    good, as an UPDATE raising the fence would: refused, whoever sends it."""
    for table, values in (
        ("jobs", f"(id, result, fence) VALUES (9, 'X', {BIGINT_MAX})"),
        ("job_steps", f"(job_id, step, output, fence) VALUES (9, 1, 'X', {BIGINT_MAX})"),
    ):  # both policies
        refused = refusal(guarded, f"INSERT INTO {table} {values}")
        assert refused.sqlstate == _guard.STALE_SQLSTATE
        assert f"INSERT on table public.{table} refused for row (" in str(refused)
        assert f"the new fence {BIGINT_MAX} is past the last token issued" in str(refused)
    refused = refusal(  # a current token cannot carry a forged fence in either
        guarded,
        "BEGIN; SELECT set_config('sa_fence.token', '7', true); "
        f"INSERT INTO jobs (id, result, fence) VALUES (9, 'X', {BIGINT_MAX})",
    )
    assert f"the new fence {BIGINT_MAX} is past the last token issued" in str(refused)
    refused = refusal(  # nor a token no lease was granted
        guarded,
        f"BEGIN; SELECT set_config('sa_fence.token', '{BIGINT_MAX}', true); "
        "INSERT INTO jobs (id, result) VALUES (9, 'X')",
    )
    assert f"token {BIGINT_MAX} is past the last token issued" in str(refused)
    assert jobs_with_id(guarded, 9) == []


def test_copy_of_a_forged_fence_is_refused_like_an_insert(guarded: sa.Engine) -> None:
    with (
        psql(guarded) as conn,
        pytest.raises(psycopg.Error) as refused,
        conn.cursor().copy("COPY jobs (id, result, fence) FROM STDIN") as copy,
    ):
        copy.write_row((9, "X", BIGINT_MAX))
    assert refused.value.sqlstate == _guard.STALE_SQLSTATE
    assert jobs_with_id(guarded, 9) == []


@pytest.mark.parametrize("removed", ["issued check", "INSERT event"])
def test_without_the_insert_guard_a_forged_fence_locks_every_later_holder_out(
    guarded: sa.Engine, monkeypatch: pytest.MonkeyPatch, removed: str
) -> None:
    """The pair of the two tests above: a guard without its comparison with the
    sequence, or a trigger that does not fire on INSERT (one made by hand, say),
    lets the forged row in, and no lease can write it again."""
    if removed == "issued check":
        monkeypatch.setattr(_guard, "ISSUED_CHECK", "false")
    else:
        monkeypatch.setattr(_guard, "EVENTS", "UPDATE OR DELETE")
    try:
        recreate_guard(guarded, "jobs", on_missing_token="unchanged")
        with psql(guarded) as conn:
            run_script(conn, f"INSERT INTO jobs (id, result, fence) VALUES (9, 'X', {BIGINT_MAX})")
            with pytest.raises(psycopg.Error, match="is stale"):  # a real holder, for good
                run_script(
                    conn,
                    f"BEGIN; SELECT set_config('sa_fence.token', '{ISSUED}', true); "
                    "UPDATE jobs SET result = 'A' WHERE id = 9",
                )
    finally:
        monkeypatch.undo()
        recreate_guard(guarded, "jobs", on_missing_token="unchanged")


def test_a_raw_insert_records_the_presented_token_and_lets_a_never_fenced_row_in(
    guarded: sa.Engine,
) -> None:
    with psql(guarded) as conn:
        run_script(
            conn,
            "BEGIN; SELECT set_config('sa_fence.token', '7', true); "
            f"INSERT INTO jobs (id, result, fence) VALUES (9, 'X', {ISSUED})",
        )
        run_script(conn, "INSERT INTO jobs (id, result, fence) VALUES (10, 'Y', 5)")
        # no token and no fence: a never-fenced row, even under a "reject" guard
        run_script(conn, "INSERT INTO job_steps (job_id, step, output) VALUES (10, 1, 'Y')")
        step = conn.execute("SELECT fence FROM job_steps WHERE job_id = 10").fetchone()
    assert jobs_with_id(guarded, 9) == [("X", 7)]  # the token, not the fence it chose
    assert jobs_with_id(guarded, 10) == [("Y", 5)]  # its fence presented as its token
    assert step is not None


def test_a_forged_fence_through_fence_connection_is_a_config_error_not_a_stale_write(
    guarded: sa.Engine, fencer: sa_fence.Fencer
) -> None:
    """Not "a newer holder wrote": no lease was granted that fence.  The error
    says what to fix (a fence set by hand, or a guard reading another sequence)."""
    insert_rows(guarded, fence=5)
    with fencer.acquire("job:9", 5) as lease, guarded.connect() as conn:
        for statement in (
            "INSERT INTO jobs (id, result, fence) VALUES (9, 'X', :f)",
            "UPDATE jobs SET fence = :f WHERE id = 1",
        ):
            with sa_fence.fence_connection(conn, lease):
                with pytest.raises(sa_fence.FencingConfigError) as refused:
                    conn.execute(sa.text(statement), {"f": BIGINT_MAX})
                conn.rollback()
            assert "past the last token issued" in str(refused.value)
            assert "sets the fence column by hand" in str(refused.value)
            assert "sequence=" in str(refused.value)
            assert getattr(refused.value.cause, "sqlstate", None) == _guard.STALE_SQLSTATE
    assert jobs_with_id(guarded, 9) == []
    assert job_row(guarded) == ("B", 5)


def test_merge_is_guarded_as_the_insert_update_and_delete_it_runs(guarded: sa.Engine) -> None:
    """PostgreSQL 15's MERGE fires the same row triggers as the actions it takes."""
    with guarded.connect() as conn:
        if conn.dialect.server_version_info < (15,):  # type: ignore[operator]
            pytest.skip("MERGE needs PostgreSQL 15")
    insert_rows(guarded, fence=50)
    merge = (
        "MERGE INTO jobs AS j USING (VALUES ({id}, 'M', {fence}::bigint)) AS v(id, result, fence) "
        "ON j.id = v.id "
        "WHEN MATCHED THEN UPDATE SET result = v.result "
        "WHEN NOT MATCHED THEN INSERT (id, result, fence) VALUES (v.id, v.result, v.fence)"
    )
    present = "BEGIN; SELECT set_config('sa_fence.token', '{token}', true); "
    refused = refusal(guarded, merge.format(id=9, fence=BIGINT_MAX))  # the INSERT action
    assert "INSERT on table public.jobs refused" in str(refused)
    assert "past the last token issued" in str(refused)
    refused = refusal(guarded, present.format(token=3) + merge.format(id=1, fence=0))  # UPDATE
    assert refused.sqlstate == _guard.STALE_SQLSTATE
    assert "token 3 is stale: the row's fence is 50" in str(refused)
    assert job_row(guarded) == ("B", 50)
    assert jobs_with_id(guarded, 9) == []


def test_orm_and_core_inserts_through_sa_fence_pass_a_reject_guard_with_their_token(
    guarded: sa.Engine, fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """The write paths a fenced INSERT takes (unit of work, ORM bulk, Core in
    fence_connection, text() in a bound session) go through the INSERT guard
    and the row records the lease's token."""
    with fencer.acquire("job:1", 5) as lease:
        with make_session() as session:
            lease.bind(session)
            session.add(DemoStep(job_id=1, step=1, output="uow"))
            session.flush()
            session.execute(sa.insert(DemoStep), [{"job_id": 1, "step": 2, "output": "bulk"}])
            session.execute(
                sa.text("INSERT INTO job_steps (job_id, step, output) VALUES (1, 3, 'text')")
            )
            session.commit()
        with guarded.connect() as conn, sa_fence.fence_connection(conn, lease):
            conn.execute(DemoStep.__table__.insert().values(job_id=1, step=4, output="core"))
            conn.commit()
    with guarded.connect() as conn:
        rows = conn.execute(sa.text("SELECT step, fence FROM job_steps ORDER BY step")).all()
    assert [tuple(r) for r in rows] == [(n, lease.token) for n in (1, 2, 3, 4)]


@pytest.mark.parametrize(
    ("policy", "sequence"),
    [("reject", "sa_fence_token_seq"), ("unchanged", "app.tokens"), ("reject", 'we"ird.s q')],
)
def test_a_guard_function_says_how_it_was_made(policy: str, sequence: str) -> None:
    """sa-fence check remakes an outdated guard as it was made: policy and sequence
    are read back from the function's source."""
    made = _guard.create_guard_sql("jobs", on_missing_token=policy, sequence=sequence)
    source = _guard.function_source(made)
    assert _guard.guard_made_with(source) == (policy, sequence)
    assert _guard.guard_made_with("BEGIN RETURN NEW; END") is None


async def test_asyncio_inserts_pass_a_reject_guard_and_a_forged_fence_is_a_config_error(
    guarded: sa.Engine, aredis: Any, key_prefix: str
) -> None:
    """The same triggers under an AsyncSession: its INSERT records the token,
    and a forged fence is refused with the same FencingConfigError."""
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    engine = create_async_engine(guarded.url.set(drivername="postgresql+psycopg_async"))
    fencer = sa_fence.AsyncFencer(aredis, engine, key_prefix=key_prefix)
    make_session = sa_fence.install(async_sessionmaker(engine))
    try:
        async with await fencer.acquire("job:1", 5) as lease, make_session() as session:
            lease.bind(session)
            session.add(DemoStep(job_id=1, step=1, output="async"))
            await session.commit()
            with pytest.raises(sa_fence.FencingConfigError, match="past the last token"):
                await session.execute(
                    sa.text("INSERT INTO jobs (id, result, fence) VALUES (9, 'X', :f)"),
                    {"f": BIGINT_MAX},
                )
            await session.rollback()
        with guarded.connect() as conn:
            step = conn.execute(sa.text("SELECT fence FROM job_steps")).scalar_one()
        assert step == lease.token
        assert jobs_with_id(guarded, 9) == []
    finally:
        await fencer.close()
        await engine.dispose()


def test_a_sequence_name_with_a_nul_character_is_refused_before_any_sql() -> None:
    """A NUL (which PostgreSQL text cannot hold) is refused with a ValueError naming the
    value, not sent: by the names' check, and by ``quote_literal`` for any other text."""
    with pytest.raises(ValueError, match="control character"):
        _guard.create_guard_sql("jobs", sequence="seq\x00")
    with pytest.raises(ValueError, match="contains a NUL character"):
        _guard.quote_literal("seq\x00")
    assert _guard.quote_literal("it's a \\ name") == "E'it''s a \\\\ name'"
