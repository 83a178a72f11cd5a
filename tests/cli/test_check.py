"""``sa-fence check`` and ``sa-fence repair-sequence`` against live databases."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import sa_fence
from sa_fence.cli import check as _check
from sa_fence.cli import main as cli
from sa_fence.cli.schema import upgrade_demo_schema
from sa_fence.db import register as _register
from tests._fresh_db import fresh_database, url_of
from tests._sql import PARTITIONED_TABLES


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
        conn.execute(sa.text("SELECT setval('sa_fence_token_seq', 41)"))  # issued, then lost
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
    assert (
        "ok lease register sa_fence_leases: tokens from sa_fence_token_seq, commit check "
        "function, rights of role postgres" in out
    )
    assert "note" not in out
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
        conn.execute(sa.text("SELECT setval('sa_fence_token_seq', 5000)"))
        conn.execute(sa.text("INSERT INTO jobs (id, fence) VALUES (1, 12)"))
    status, out, _ = sa_fence_cli(
        "repair-sequence", "--url", url_of(migrated), "--yes", capsys=capsys
    )
    assert status == 0
    assert "Nothing to do: the sequence is already at or past 1012" in out
    assert sequence_last_value(migrated) == 5000


def test_repair_sequence_refuses_a_sequence_that_is_no_token_sequence_and_moves_nothing(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """A table's serial named by mistake (integer, cached) is refused with what check says
    of it, and stays where it was."""
    execute(migrated, "CREATE SEQUENCE a_serial AS integer CACHE 20")
    status, _, err = sa_fence_cli(
        "repair-sequence",
        "--url",
        url_of(migrated),
        "--sequence",
        "a_serial",
        "--yes",
        capsys=capsys,
    )
    assert status == 1
    assert "It is not a token sequence" in err
    assert "Nothing was changed." in err
    assert "integer" in err  # the fitness problem, as check names it
    with migrated.connect() as conn:
        assert conn.execute(sa.text("SELECT last_value FROM a_serial")).scalar_one() == 1


def test_check_names_a_missing_guard_and_a_cached_sequence_with_their_fixes(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with migrated.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER sa_fence_guard ON job_steps"))
        conn.execute(sa.text("ALTER SEQUENCE sa_fence_token_seq CACHE 20 CYCLE"))
        conn.execute(sa.text("CREATE TABLE legacy (id int PRIMARY KEY, fence bigint)"))
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    # a table with no guard is advice (a problem only with --strict)
    assert "1 problem(s) found. 2 piece(s) of advice" in out
    assert (
        "PROBLEM token sequence sa_fence_token_seq cannot issue fencing tokens: it has CACHE 20"
        in out
    )
    assert "it is CYCLE" in out
    assert 'ALTER SEQUENCE "sa_fence_token_seq" AS bigint CACHE 1 NO CYCLE' in out
    assert "advice table job_steps has no enabled guard trigger sa_fence_guard" in out
    assert "fix: sa-fence create-guard --url ... job_steps" in out
    assert "in an Alembic migration: op.create_fence_guard('job_steps')" in out
    assert "in an Alembic migration: op.create_fence_guard('legacy')" in out


def test_check_counts_a_disabled_guard_as_a_problem_not_advice(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(migrated, "ALTER TABLE jobs DISABLE TRIGGER sa_fence_guard")
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert (status, out.count("PROBLEM")) == (1, 1)
    assert "PROBLEM table jobs has no enabled guard trigger sa_fence_guard" in out
    assert "in an Alembic migration: op.create_fence_guard('jobs')" in out


def test_check_names_guards_that_are_not_the_ones_this_sa_fence_creates(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trigger not firing on INSERT, a function edited by hand or made by
    another version: each reported, with the call that remakes the guard as it
    was made (its policy and sequence, read from the function's header)."""
    with migrated.connect() as conn:
        source = conn.execute(
            sa.text("SELECT prosrc FROM pg_proc WHERE proname = 'sa_fence_guard_job_steps'")
        ).scalar_one()
    edited = source.replace("-- Generated by sa_fence", "-- Edited by hand; generated by sa_fence")
    execute(
        migrated,
        "CREATE OR REPLACE FUNCTION sa_fence_guard_job_steps() RETURNS trigger "
        f"LANGUAGE plpgsql AS $body${edited}$body$",
        "DROP TRIGGER sa_fence_guard ON jobs",
        "CREATE TRIGGER sa_fence_guard BEFORE UPDATE OR DELETE ON jobs "
        "FOR EACH ROW EXECUTE FUNCTION sa_fence_guard_jobs()",
    )
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert (status, out.count("PROBLEM")) == (1, 2)
    outdated = "has a guard trigger sa_fence_guard that is not the one this sa-fence creates:"
    assert (
        f"PROBLEM table jobs {outdated} it does not fire before each INSERT, UPDATE and "
        "DELETE, so a raw INSERT with a forged fence would lock every later holder out of "
        "its row fix: op.create_fence_guard('jobs', on_missing_token='unchanged') "
        "(recreates it)" in out
    )
    assert (
        f"PROBLEM table job_steps {outdated} its function differs (made by another sa-fence "
        "version, or edited by hand) fix: op.create_fence_guard('job_steps') (recreates it)" in out
    )
    execute(
        migrated,
        "CREATE OR REPLACE FUNCTION sa_fence_guard_jobs() RETURNS trigger "
        "LANGUAGE plpgsql AS $body$BEGIN RETURN NEW; END$body$",
    )
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert (
        f"PROBLEM table jobs {outdated} it does not fire before each INSERT, UPDATE and "
        "DELETE, so a raw INSERT with a forged fence would lock every later holder out of "
        "its row; its function was not made by sa-fence (or was edited by hand) fix: "
        "op.create_fence_guard('jobs', on_missing_token='reject' or 'unchanged') "
        "(recreates it)" in out
    )


def test_check_with_metadata_finds_a_fenced_model_whose_table_lacks_its_column(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with migrated.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER sa_fence_guard ON jobs"))
        conn.execute(sa.text("ALTER TABLE jobs DROP COLUMN fence"))
    status, out, _ = sa_fence_cli(
        "check",
        "--url",
        url_of(migrated),
        "--metadata",
        "sa_fence.cli.demo_models:DemoBase",
        capsys=capsys,
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
    for argv, message in [
        (["repair-sequence", "--url", "postgresql://x/y", "--margin", "-5"], "between 0 and"),
        (["repair-sequence", "--url", "postgresql://x/y", "--margin", "5%"], "not a whole number"),
        (["demo", "--ttl", "soon"], "--ttl: not a number of seconds: 'soon'"),
        (["demo", "--ttl", "600"], "--ttl: must be between 0.1 and 60 seconds, got 600"),
        (["status", "--url", "postgresql://x/y", "--limit", "0"], "must be between 1 and"),
    ]:
        with pytest.raises(SystemExit) as usage:
            cli.main(argv)
        assert usage.value.code == 2
        assert message in capsys.readouterr().err


# ------------------------------------------------------------ the lease register


def execute(engine: sa.Engine, *statements: str) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(sa.text(statement))


def test_check_names_a_missing_lease_register_with_its_fix(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(
        migrated,
        "DROP FUNCTION sa_fence_check_lease(text, bigint)",
        "DROP TABLE sa_fence_leases",
    )
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert "1 problem(s) found." in out
    assert (
        "PROBLEM lease register sa_fence_leases does not exist: no Fencer grants a lease "
        "without it" in out
    )
    assert "fix: in a migration, after the sequence: op.create_fence_register();" in out


def test_check_names_a_lease_register_of_the_wrong_shape(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(
        migrated,
        "ALTER TABLE sa_fence_leases DROP COLUMN previous",
        "ALTER TABLE sa_fence_leases ALTER COLUMN granted_at DROP NOT NULL",
        "ALTER TABLE sa_fence_leases ALTER COLUMN granted_at TYPE timestamp",
    )
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert (
        "PROBLEM lease register sa_fence_leases has the wrong shape: column 'granted_at' is "
        "timestamp without time zone (need timestamp with time zone); column 'granted_at' "
        "allows NULL (need NOT NULL); has no column 'previous' (bigint)" in " ".join(out.split())
    )
    assert "op.drop_fence_register() and op.create_fence_register()" in out


def test_check_names_a_register_drawing_from_another_sequence_or_from_none(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(
        migrated,
        "CREATE SEQUENCE other_seq AS bigint CACHE 1",
        "ALTER TABLE sa_fence_leases ALTER COLUMN token SET DEFAULT nextval('other_seq')",
    )
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert (
        "PROBLEM lease register sa_fence_leases draws its tokens from sequence other_seq, not "
        "from sa_fence_token_seq: a Fencer naming sa_fence_token_seq is refused" in out
    )
    assert "check with --sequence other_seq" in out
    status, out, _ = sa_fence_cli(
        "check", "--url", url_of(migrated), "--sequence", "other_seq", capsys=capsys
    )
    assert "draws its tokens from sequence" not in out
    execute(migrated, "ALTER TABLE sa_fence_leases ALTER COLUMN token DROP DEFAULT")
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert "PROBLEM lease register sa_fence_leases draws its tokens from no sequence" in out
    assert (
        'fix: ALTER TABLE "sa_fence_leases" ALTER COLUMN token SET DEFAULT '
        "nextval('\"sa_fence_token_seq\"');" in out
    )


def test_check_names_a_missing_commit_check_function(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(migrated, "DROP FUNCTION sa_fence_check_lease(text, bigint)")
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert (
        'PROBLEM commit check function "sa_fence_check_lease"(text, bigint) is missing: no '
        "session bound to a lease can commit fix: op.create_fence_register() (keeps the "
        "register's rows)" in out
    )


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        (
            "DROP TABLE sa_fence_scope",
            "the lease scope table public.sa_fence_scope is missing, so a COMMIT the client "
            "sends itself would not be checked",
        ),
        (
            "DROP TRIGGER sa_fence_scope_check ON sa_fence_scope",
            "the lease scope trigger sa_fence_scope_check on public.sa_fence_scope is missing, "
            "so a COMMIT the client sends itself would not be checked",
        ),
        (
            "DROP TRIGGER sa_fence_scope_check ON sa_fence_scope; "
            "CREATE CONSTRAINT TRIGGER sa_fence_scope_check AFTER INSERT ON sa_fence_scope "
            "NOT DEFERRABLE FOR EACH ROW EXECUTE FUNCTION sa_fence_scope_check()",
            "the lease scope trigger sa_fence_scope_check on public.sa_fence_scope is not "
            "DEFERRABLE INITIALLY DEFERRED, so it would check at the first write, not at COMMIT",
        ),
        (
            "ALTER TABLE sa_fence_scope ENABLE TRIGGER sa_fence_scope_check",
            "the lease scope trigger sa_fence_scope_check on public.sa_fence_scope fires only "
            "while session_replication_role is origin or local, so a COMMIT of a session in "
            "another mode would not be checked against the register. Fix: ALTER TABLE "
            "public.sa_fence_scope ENABLE ALWAYS TRIGGER sa_fence_scope_check;",
        ),
        (
            "ALTER TABLE sa_fence_scope ENABLE REPLICA TRIGGER sa_fence_scope_check",
            "fires only while session_replication_role is replica,",
        ),
    ],
    ids=["table", "trigger", "not deferred", "origin only", "replica only"],
)
def test_check_names_a_missing_scope_table_or_trigger_with_the_fix(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str], broken: str, said: str
) -> None:
    execute(migrated, broken)
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    out = " ".join(out.split())
    assert said in out
    assert "op.create_fence_register()" in out


def test_check_names_a_disabled_scope_trigger_with_the_fix(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """Disabled, PostgreSQL would not check a COMMIT the client sends itself."""
    execute(migrated, "ALTER TABLE sa_fence_scope DISABLE TRIGGER sa_fence_scope_check")
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert (
        "the lease scope trigger sa_fence_scope_check on public.sa_fence_scope is disabled" in out
    )
    assert "ALTER TABLE public.sa_fence_scope ENABLE ALWAYS TRIGGER sa_fence_scope_check;" in out
    execute(migrated, "ALTER TABLE sa_fence_scope ENABLE ALWAYS TRIGGER sa_fence_scope_check")
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 0, out


@pytest.fixture
def worker_role(migrated: sa.Engine) -> Iterator[str]:
    """A login role with no rights of its own (dropped afterwards)."""
    name = f"sa_fence_test_{uuid.uuid4().hex[:10]}"
    execute(migrated, f'CREATE ROLE "{name}" LOGIN')
    try:
        yield name
    finally:
        execute(migrated, f'DROP OWNED BY "{name}"', f'DROP ROLE "{name}"')


def test_check_names_the_rights_the_connecting_role_lacks_with_the_grants(
    migrated: sa.Engine, worker_role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(
        migrated,
        f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{worker_role}"',
        "REVOKE EXECUTE ON FUNCTION sa_fence_check_lease("
        f"{_register.FUNCTIONS['sa_fence_check_lease']}) FROM PUBLIC",
    )
    url = migrated.url.set(username=worker_role).render_as_string(hide_password=False)
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 1
    assert (
        f"PROBLEM role {worker_role} (the role this check connected as: run it as your "
        "workers' role) lacks EXECUTE on function sa_fence_grant(text, regclass, text, "
        "boolean), EXECUTE on function sa_fence_withdraw(text, bigint), SELECT on sequence "
        "sa_fence_token_seq, INSERT on sa_fence_scope: every grant, the withdrawal of a token "
        "whose grant was never confirmed, every fenced write that raises a row's fence (its "
        "guard reads the sequence) and every transaction of a bound session fail with "
        "permission denied" in out
    )
    # the check function is for raw writers' hand-sent checks: a bound session's COMMIT is
    # checked by the scope trigger, which needs no EXECUTE (revoked above, and not asked for)
    assert "sa_fence_check_lease" not in out
    for grant in (
        f'GRANT EXECUTE ON FUNCTION "sa_fence_grant"(text, regclass, text, boolean) TO '
        f'"{worker_role}";',
        f'GRANT EXECUTE ON FUNCTION "sa_fence_withdraw"(text, bigint) TO "{worker_role}";',
        f'GRANT SELECT ON SEQUENCE "sa_fence_token_seq" TO "{worker_role}";',
        f'GRANT INSERT ON "sa_fence_scope" TO "{worker_role}";',
    ):
        assert grant in out
        execute(migrated, grant)
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 0, out
    assert f"rights of role {worker_role}" in out
    # the documented role may write neither the register nor the arms: nothing to warn of
    assert "warning" not in out


def documented_grants(role: str) -> list[str]:
    """The grants of docs/topologies.md ("PostgreSQL role") for the demo schema's tables."""
    return [
        "GRANT EXECUTE ON FUNCTION sa_fence_grant(text, regclass, text, boolean), "
        f'sa_fence_withdraw(text, bigint) TO "{role}"',
        f'GRANT SELECT ON sa_fence_leases TO "{role}"',
        f'GRANT SELECT ON SEQUENCE sa_fence_token_seq TO "{role}"',
        f'GRANT INSERT ON sa_fence_scope TO "{role}"',
        f'GRANT SELECT, INSERT, UPDATE, DELETE ON jobs, job_steps TO "{role}"',
    ]


def test_check_names_a_role_that_can_write_the_register_or_the_arms_with_the_revoke(
    migrated: sa.Engine, worker_role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stale holder whose role may UPDATE the register (one column is enough) writes its
    token back and shuts the current holder out: a problem, with the REVOKE that ends it,
    naming the roles the rights come through (PUBLIC, a group role the worker inherits from)."""
    group = f"sa_fence_test_{uuid.uuid4().hex[:10]}"
    execute(migrated, f'CREATE ROLE "{group}" NOLOGIN')
    try:
        execute(
            migrated,
            *documented_grants(worker_role),
            f'GRANT UPDATE (token) ON sa_fence_leases TO "{worker_role}"',
            "GRANT TRUNCATE ON sa_fence_leases TO PUBLIC",
            f'GRANT DELETE ON sa_fence_scope TO "{group}"',
            f'GRANT "{group}" TO "{worker_role}"',
        )
        url = migrated.url.set(username=worker_role).render_as_string(hide_password=False)
        for strict in ((), ("--strict",)):
            status, out, _ = sa_fence_cli("check", *strict, "--url", url, capsys=capsys)
            assert (status, out.count("PROBLEM")) == (1, 2), out
        assert (
            f"PROBLEM role {worker_role} can write the lease register sa_fence_leases itself "
            f"(UPDATE, TRUNCATE) (granted to PUBLIC, role {worker_role}): a stale holder running "
            "as it could write its token back and shut the current holder out fix: REVOKE "
            f'INSERT, UPDATE, DELETE, TRUNCATE ON "sa_fence_leases" FROM PUBLIC, "{worker_role}";'
            in out
        )
        assert (
            f"PROBLEM role {worker_role} can delete or change rows of the lease scope table "
            f"sa_fence_scope (DELETE) (granted to role {group}): the workers' role needs INSERT "
            "alone there (its arm); only sa-fence's scope trigger takes an arm back fix: "
            f'REVOKE UPDATE, DELETE, TRUNCATE ON "sa_fence_scope" FROM "{group}";' in out
        )
        assert "warning" not in out  # REVOKE helps: a problem, not a warning
        for revoke in out.split("fix: ")[1:]:
            execute(migrated, revoke.split(";")[0])
        status, out, _ = sa_fence_cli("check", "--strict", "--url", url, capsys=capsys)
        assert status == 0, out
        assert f"rights of role {worker_role}" in out
    finally:
        execute(migrated, f'DROP OWNED BY "{group}"', f'DROP ROLE "{group}"')


def test_check_warns_of_a_superuser_or_an_owner_without_failing(
    migrated: sa.Engine, worker_role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No REVOKE takes a write from a superuser or from the register's owner: a warning, not
    counted as a problem even with --strict (check is run as the migrations' role too)."""
    for strict in ((), ("--strict",)):
        status, out, _ = sa_fence_cli("check", *strict, "--url", url_of(migrated), capsys=capsys)
        assert (status, "PROBLEM" in out) == (0, False), out
        assert (
            "warning role postgres (the role this check connected as) is a superuser: it can "
            "write the lease register sa_fence_leases itself (INSERT, UPDATE, DELETE, TRUNCATE) "
            "and delete or change rows of the lease scope table sa_fence_scope (UPDATE, DELETE, "
            "TRUNCATE), and no REVOKE takes that from a superuser or an owner. A stale holder "
            "running as it could write its token back and shut the current holder out" in out
        )
        assert (
            "fix: run the workers as a role that neither owns the schema nor is a superuser" in out
        )
        assert "REVOKE INSERT" not in out
        assert "No problems found. 1 warning(s) about the role this check connected as" in out
    execute(
        migrated,
        *documented_grants(worker_role),
        f'ALTER TABLE sa_fence_leases OWNER TO "{worker_role}"',
    )
    url = migrated.url.set(username=worker_role).render_as_string(hide_password=False)
    status, out, _ = sa_fence_cli("check", "--strict", "--url", url, capsys=capsys)
    assert (status, "PROBLEM" in out) == (0, False), out
    assert (
        f"warning role {worker_role} (the role this check connected as) owns the lease "
        "register sa_fence_leases: it can write the lease register sa_fence_leases itself "
        "(INSERT, UPDATE, DELETE, TRUNCATE), and no REVOKE takes that from" in out
    )
    assert "sa_fence_scope (" not in out  # it may only arm, as the documented role


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        (
            "edit grant",  # the forward-only guard taken out of the grant
            "function sa_fence_grant(text, regclass, text, boolean) has a body that is not "
            "sa-fence's (edited by hand, or made by an earlier release)",
        ),
        (
            "ALTER FUNCTION sa_fence_withdraw(text, bigint) SECURITY INVOKER",
            "function sa_fence_withdraw(text, bigint) is not SECURITY DEFINER",
        ),
        (
            "DROP INDEX sa_fence_leases_token",
            "the register's unique index sa_fence_leases_token on token is missing",
        ),
    ],
    ids=["body", "invoker", "token index"],
)
def test_check_names_register_functions_and_index_not_as_sa_fence_makes_them(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str], broken: str, said: str
) -> None:
    """What op.create_fence_register() mends, each a problem with that fix; running its
    statements again makes the check clean."""
    if broken == "edit grant":
        with migrated.connect() as conn:
            source = conn.execute(
                sa.text(
                    "SELECT pg_get_functiondef("
                    "'sa_fence_grant(text, regclass, text, boolean)'::regprocedure)"
                )
            ).scalar_one()
        broken = source.replace("WHERE r.token OPERATOR(pg_catalog.<) EXCLUDED.token", "")
        assert broken != source
        assert "SECURITY DEFINER" in broken
    execute(migrated, broken)
    url = url_of(migrated)
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert (status, out.count("PROBLEM")) == (1, 1), out
    assert (
        f"PROBLEM lease register sa_fence_leases is not as sa-fence makes it: {said} fix: "
        "op.create_fence_register() in a migration (idempotent; keeps the register's rows)" in out
    )
    execute(migrated, *_register.create_register_sql("sa_fence_token_seq"))
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert (status, "PROBLEM" in out) == (0, False), out


def test_check_warns_that_two_registers_in_one_database_let_a_stale_holder_commit(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(
        migrated,
        "CREATE SCHEMA other",
        "CREATE SEQUENCE other.tokens AS bigint CACHE 1",
        *_register.create_register_sql("other.tokens"),
    )
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert (
        "PROBLEM lease registers 2 in this database: other.sa_fence_leases (tokens from "
        "other.tokens), sa_fence_leases (tokens from sa_fence_token_seq)." in out
    )
    assert "so that stale holder's commit goes through" in out
    assert "fix: give every Fencer of this database one sequence" in out


def test_check_counts_never_fenced_null_fences_in_a_note_not_a_problem(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(
        migrated,
        "ALTER TABLE jobs ALTER COLUMN fence DROP NOT NULL",
        "INSERT INTO jobs (id, fence) VALUES (1, NULL), (2, NULL), (3, 0)",
    )
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 0, out
    backfill = (
        'UPDATE "jobs" SET "fence" = 0 WHERE "fence" IS NULL; '
        'ALTER TABLE "jobs" ALTER COLUMN "fence" SET NOT NULL;'
    )
    assert (
        "note table jobs: 2 row(s) with a NULL fence (never fenced: any lease may write them, "
        "and the first fenced write sets the fence). To make the column NOT NULL: "
        + backfill
        in out
    )
    execute(migrated, *backfill.split("; "))  # the documented backfill works as printed
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert (status, "note" in out) == (0, False), out


def test_check_and_repair_take_a_register_ahead_of_the_sequence_into_account(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a failover the register can be ahead of the rows: the target passes both."""
    restored_behind(migrated)  # rows up to 41, sequence at 7
    execute(migrated, "INSERT INTO sa_fence_leases (name, token) VALUES ('job:1', 500)")
    url = url_of(migrated)
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 1
    assert (
        "max(fence) of jobs is 41, max(token) of the lease register sa_fence_leases is 500. " in out
    )
    assert (
        "a new grant would draw a token at or below one already granted: such a grant is "
        "refused (the register only moves forward)" in out
    )
    assert "(moves it to 500 + margin)" in out
    status, out, _ = sa_fence_cli(
        "repair-sequence", "--url", url, "--margin", "100", "--yes", capsys=capsys
    )
    assert status == 0, out
    assert (
        "sequence sa_fence_token_seq: last value 7; largest fence 41; largest registered "
        "token 500 (sa_fence_leases); margin 100" in out
    )
    assert "Moved sa_fence_token_seq to 600; the next token is 601." in out
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 0, out
    assert "and max(token) 500 of the lease register" in out


def test_check_reports_whatever_a_fencer_would_refuse_that_it_has_no_rule_for(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """check defers to the Fencer's own set-up test (setup_problem): never "No problems"
    for a database a Fencer refuses."""
    monkeypatch.setattr(_check, "setup_problem", lambda conn, sequence: "a new rule says no")
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert (
        "PROBLEM lease register sa_fence_leases a Fencer would refuse it: a new rule says no" in out
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["check", "--sequence", ""], "argument --sequence: must be a non-empty name"),
        (["repair-sequence", "--column", ""], "argument --column: must be a non-empty name"),
        (["status", "--sequence", ""], "argument --sequence: must be a non-empty name"),
        (["create-guard", ""], "argument TABLE: must be a non-empty name"),
        (["create-guard", "jobs", "--schema", "a\nb"], "argument --schema: must be a non-empty"),
        (["repair-sequence", "--margin", str(2**63 - 1)], "must be between 0 and 2**62"),
    ],
)
def test_the_commands_refuse_a_bad_argument_with_usage_not_a_traceback(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """Each raised a traceback from inside (exit 1), or reached the server; now argparse's
    exit 2, naming the argument."""
    with pytest.raises(SystemExit) as exited:
        cli.main([argv[0], "--url", url_of(migrated), *argv[1:]])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("driver", ["psycopg2", "asyncpg", "psycopg_async"])
def test_a_url_with_another_driver_is_refused_naming_psycopg(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str], driver: str
) -> None:
    url = migrated.url.set(drivername=f"postgresql+{driver}")
    status, _, err = sa_fence_cli(
        "check", "--url", url.render_as_string(hide_password=False), capsys=capsys
    )
    assert status == 2
    assert "the tools connect with psycopg 3: use postgresql+psycopg://" in err


def test_a_plain_postgresql_url_is_taken_as_psycopgs(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLAlchemy's default PostgreSQL driver is psycopg2, which sa-fence does not install."""
    url = migrated.url.set(drivername="postgresql").render_as_string(hide_password=False)
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 0, out


# ------------------------------------------- guards that do not fence the workers' writes


def test_check_names_a_guard_reading_another_sequence_than_the_fencers_with_both_fixes(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guard refuses every token past its own sequence's last value as never issued: on
    another sequence than the Fencers', every holder's write is refused."""
    execute(migrated, "CREATE SEQUENCE other_seq AS bigint CACHE 1 NO CYCLE")
    sa_fence.create_fence_guard(
        migrated, "jobs", on_missing_token="unchanged", sequence="other_seq"
    )
    url = url_of(migrated)
    status, out, _ = sa_fence_cli("check", "--strict", "--url", url, capsys=capsys)
    assert (status, out.count("PROBLEM")) == (1, 1), out
    assert (
        "PROBLEM table jobs has a guard trigger sa_fence_guard that is not the one this "
        "sa-fence creates: it reads the token sequence other_seq, not sa_fence_token_seq, the "
        "one the Fencers draw tokens from" in out
    )
    assert (
        "fix: op.create_fence_guard('jobs', on_missing_token='unchanged', "
        "sequence='sa_fence_token_seq') (recreates it); without Alembic: sa-fence "
        "create-guard --url ... jobs --on-missing-token unchanged --sequence "
        "sa_fence_token_seq" in out
    )
    assert "If your Fencers do draw their tokens from other_seq, check with --sequence" in out
    # the same sequence, named schema-qualified: current
    sa_fence.create_fence_guard(
        migrated, "jobs", on_missing_token="unchanged", sequence="public.sa_fence_token_seq"
    )
    status, out, _ = sa_fence_cli("check", "--strict", "--url", url, capsys=capsys)
    assert status == 0, out
    # a sequence named on the command line: the fix names it, and works as printed
    execute(
        migrated, "ALTER TABLE sa_fence_leases ALTER COLUMN token SET DEFAULT nextval('other_seq')"
    )
    status, out, _ = sa_fence_cli("check", "--url", url, "--sequence", "other_seq", capsys=capsys)
    assert "it reads the token sequence public.sa_fence_token_seq, not other_seq" in out
    assert "sa-fence create-guard --url ... job_steps --sequence other_seq" in out
    status, _, err = sa_fence_cli(
        "create-guard", "--url", url, "job_steps", "--sequence", "other_seq", capsys=capsys
    )
    assert status == 0, err
    status, out, _ = sa_fence_cli("check", "--url", url, "--sequence", "other_seq", capsys=capsys)
    assert "table job_steps" not in out.split("PROBLEM", 1)[-1], out


@pytest.mark.parametrize(
    ("ddl", "said"),
    [
        (
            ["ALTER TABLE jobs ENABLE REPLICA TRIGGER sa_fence_guard"],
            "it is ENABLE REPLICA: it fires in replica mode only, for no ordinary writer",
        ),
        (
            [
                "DROP TRIGGER sa_fence_guard ON jobs",
                "CREATE TRIGGER sa_fence_guard BEFORE INSERT OR UPDATE OF fence OR DELETE ON "
                "jobs FOR EACH ROW EXECUTE FUNCTION sa_fence_guard_jobs()",
            ],
            "it fires on UPDATE OF some columns only: other UPDATEs are not fenced",
        ),
        (
            [
                "DROP TRIGGER sa_fence_guard ON jobs",
                "CREATE TRIGGER sa_fence_guard BEFORE INSERT OR UPDATE OR DELETE ON jobs "
                "FOR EACH ROW WHEN (pg_trigger_depth() < 0) "
                "EXECUTE FUNCTION sa_fence_guard_jobs()",
            ],
            "it has a WHEN condition: the writes it skips are not fenced",
        ),
    ],
    ids=["enable replica", "update of", "when"],
)
def test_check_names_a_guard_that_does_not_fire_for_ordinary_writers(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str], ddl: list[str], said: str
) -> None:
    """Ordinary writers' UPDATEs (or all their writes) skip such a trigger: not the guard
    check promises.  Recreating the guard, as the fix says, makes it one."""
    execute(migrated, *ddl)
    url = url_of(migrated)
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert (status, out.count("PROBLEM")) == (1, 1), out
    assert (
        "PROBLEM table jobs has a guard trigger sa_fence_guard that is not the one this "
        f"sa-fence creates: {said} fix: op.create_fence_guard('jobs', "
        "on_missing_token='unchanged') (recreates it); without Alembic: sa-fence create-guard "
        "--url ... jobs --on-missing-token unchanged" in out
    )
    status, _, err = sa_fence_cli(
        "create-guard", "--url", url, "jobs", "--on-missing-token", "unchanged", capsys=capsys
    )
    assert status == 0, err
    status, out, _ = sa_fence_cli("check", "--strict", "--url", url, capsys=capsys)
    assert status == 0, out


# ------------------------------------------------------------ partitioned tables


@pytest.fixture
def partitioned(migrated: sa.Engine) -> sa.Engine:
    """A partitioned fenced table (two levels) guarded on its parent, as PostgreSQL wants."""
    execute(migrated, *PARTITIONED_TABLES)
    sa_fence.create_fence_guard(migrated, "parted")
    return migrated


def test_check_takes_partitions_as_fenced_by_their_partitioned_tables_guard(
    partitioned: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guard PostgreSQL clones onto each partition runs the parent's function: no
    "function differs" for each partition, and its fences are read through the parent."""
    url = url_of(partitioned)
    execute(partitioned, "SELECT setval('sa_fence_token_seq', 150)")
    execute(partitioned, "INSERT INTO parted (id, fence) VALUES (1, 20), (120, 150)")
    status, out, _ = sa_fence_cli("check", "--strict", "--url", url, capsys=capsys)
    assert (status, "PROBLEM" in out) == (0, False), out
    assert "ok table parted: column fence, guard sa_fence_guard" in out
    assert "parted_a" not in out
    # a partition's copy switched off on its own is named, with the fix
    execute(partitioned, "ALTER TABLE parted_b1 DISABLE TRIGGER sa_fence_guard")
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 1
    assert (
        "PROBLEM table parted has a guard trigger sa_fence_guard that is not the one this "
        "sa-fence creates: its copy on partition parted_b1 is disabled, so writes to that "
        "partition are not fenced fix: op.create_fence_guard('parted') (recreates it)" in out
    )
    status, _, err = sa_fence_cli("create-guard", "--url", url, "parted", capsys=capsys)
    assert status == 0, err
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 0, out


# -------------------------------------------- repair-sequence: fences past any token


def test_repair_sequence_refuses_fences_no_sequence_can_pass_and_changes_nothing(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fence near 2**63-1 (loaded with the guard disabled): max(fence) + margin is past any
    bigint; setval cannot take it, and no sequence could issue a token past it anyway."""
    huge = 2**63 - 1 - 500
    execute(
        migrated,
        "ALTER TABLE jobs DISABLE TRIGGER sa_fence_guard",
        f"INSERT INTO jobs (id, fence) VALUES (1, 3), (2, {huge})",
        "ALTER TABLE jobs ENABLE TRIGGER sa_fence_guard",
    )
    url = url_of(migrated)
    status, out, _ = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert status == 1
    assert "these fences are past any token the sequence can issue once moved past them" in out
    assert 'SELECT * FROM "jobs" WHERE "fence" > 0 ORDER BY "fence" DESC;' in out
    status, out, err = sa_fence_cli("repair-sequence", "--url", url, "--yes", capsys=capsys)
    assert status == 1
    assert (
        f"sa-fence repair-sequence: cannot move sequence sa_fence_token_seq to {huge} + margin "
        f"1000: that is past {2**63 - 1}, the largest value a bigint sequence holds (a "
        "--margin of at most 500 fits" in err
    )
    assert 'Find them: SELECT * FROM "jobs" WHERE "fence" > 0 ORDER BY "fence" DESC;' in err
    assert err.endswith("Nothing was changed.")
    assert "Moved" not in out
    assert sequence_last_value(migrated) == 1  # (never called)


# ------------------------------------------ a role lacking rights: a message, no traceback


def test_check_and_repair_name_a_fenced_table_the_role_may_not_read_with_the_grant(
    migrated: sa.Engine, worker_role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(  # a workers' role, but for job_steps
        migrated,
        f'GRANT SELECT ON jobs, sa_fence_leases TO "{worker_role}"',
        f'GRANT USAGE ON SEQUENCE sa_fence_token_seq TO "{worker_role}"',
    )
    url = migrated.url.set(username=worker_role).render_as_string(hide_password=False)
    status, out, err = sa_fence_cli("check", "--url", url, capsys=capsys)
    assert (status, err) == (1, "")
    assert (
        f"PROBLEM table job_steps cannot be read by role {worker_role} (no SELECT): its fences "
        "are unknown" in out
    )
    assert f'GRANT SELECT ON "job_steps" TO "{worker_role}";' in out
    status, out, err = sa_fence_cli("repair-sequence", "--url", url, "--yes", capsys=capsys)
    assert status == 1
    assert (
        f"sa-fence repair-sequence: role {worker_role} may not read table(s) job_steps (no "
        "SELECT): their fences are unknown" in err
    )
    assert err.endswith("Nothing was changed.")
    # every table readable, but the sequence may not be moved: refused before asking
    restored_behind(migrated)
    execute(migrated, f'GRANT SELECT ON job_steps TO "{worker_role}"')
    status, out, err = sa_fence_cli("repair-sequence", "--url", url, capsys=capsys)
    assert status == 1
    assert (
        f"sa-fence repair-sequence: role {worker_role} may not move sequence "
        "sa_fence_token_seq: run repair-sequence as the sequence's owner" in err
    )
    assert f'GRANT UPDATE ON SEQUENCE "sa_fence_token_seq" TO "{worker_role}";' in err
    assert sequence_last_value(migrated) == 7


def test_create_guard_as_a_role_that_may_not_names_the_failure_and_the_fix(
    migrated: sa.Engine, worker_role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = migrated.url.set(username=worker_role).render_as_string(hide_password=False)
    status, out, err = sa_fence_cli("create-guard", "--url", url, "jobs", capsys=capsys)
    assert (status, out) == (1, "")
    assert err.startswith(
        "sa-fence create-guard: creating the guard of table jobs failed: permission denied"
    )
    assert "Fix: run create-guard as the owner of jobs (the role your migrations run as)" in err
    assert err.endswith("Nothing was created.")


def test_a_statement_the_server_refuses_is_one_line_naming_it_not_a_traceback(
    migrated: sa.Engine,
) -> None:
    err = io.StringIO()
    status = _check.with_connection(
        url_of(migrated),
        None,
        err,
        lambda conn, _: conn.execute(sa.text("SELECT * FROM no_such_table")).rowcount,
        command="sa-fence check",
    )
    assert status == 1
    assert err.getvalue().splitlines() == [
        'sa-fence check: running SELECT * FROM no_such_table failed: relation "no_such_table" '
        "does not exist"
    ]


def test_repair_sequence_takes_the_end_of_input_for_no(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --yes and no one to answer (stdin closed: a script, CI): input() raises EOFError."""
    restored_behind(migrated)

    def closed(prompt: str) -> str:
        raise EOFError

    monkeypatch.setattr("builtins.input", closed)
    status, out, _ = sa_fence_cli("repair-sequence", "--url", url_of(migrated), capsys=capsys)
    assert status == 1
    assert "Aborted: no answer (end of input); nothing changed. Run with --yes" in out
    assert sequence_last_value(migrated) == 7


@pytest.mark.parametrize("value", ["false", "off"])
def test_check_advises_where_autovacuum_is_off_for_the_scope_table(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """issue 48: every armed transaction leaves a dead row in the scope table, which only
    (auto)vacuum clears; advice, a problem with --strict, and gone once autovacuum is back."""
    _, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert "is not vacuumed" not in out
    execute(migrated, f"ALTER TABLE sa_fence_scope SET (autovacuum_enabled = {value})")
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    flat = " ".join(out.split())
    assert status == 0
    assert "lease scope table sa_fence_scope is not vacuumed (autovacuum is off for it;" in flat
    assert 'ALTER TABLE "public"."sa_fence_scope" RESET (autovacuum_enabled);' in flat
    strict, _, _ = sa_fence_cli("check", "--strict", "--url", url_of(migrated), capsys=capsys)
    assert strict == 1
    execute(migrated, "ALTER TABLE sa_fence_scope RESET (autovacuum_enabled)")
    _, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert "is not vacuumed" not in out


def test_check_advises_where_dead_rows_pile_up_with_autovacuum_off_on_the_server(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with migrated.connect() as conn:
        if conn.execute(sa.text("SHOW autovacuum")).scalar_one() != "off":
            pytest.skip("autovacuum is on on this server: nothing piles up")
    with migrated.connect() as conn:  # dead rows: inserts rolled back (no trigger runs)
        conn.execute(
            sa.text(
                "INSERT INTO sa_fence_scope (token, name_key) "
                "SELECT g, 0 FROM generate_series(1, :n) g"
            ),
            {"n": _check.SCOPE_DEAD_ROWS_ADVISED},
        )
        conn.rollback()
        conn.execute(sa.text("SELECT pg_stat_force_next_flush()"))
        conn.commit()
    status, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    flat = " ".join(out.split())
    assert status == 0
    assert "is not vacuumed (autovacuum is off on this server, and" in flat
    with migrated.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM sa_fence_scope"))
        conn.execute(sa.text("SELECT pg_stat_force_next_flush()"))
    _, out, _ = sa_fence_cli("check", "--url", url_of(migrated), capsys=capsys)
    assert "is not vacuumed" not in out
