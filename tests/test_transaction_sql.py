"""SQL text that ends its transaction and goes on is found as PostgreSQL splits it.

``sa_fence._transaction_sql`` decides which ``text()``, driver SQL or DDL a bound
connection refuses (``COMMIT; BEGIN``, ``COMMIT; INSERT ...``, ``COMMIT AND CHAIN``:
what follows would run outside lease scope; tests/test_scope_trigger.py has the
refusals and the guard-removal pair).  Here its verdict is held to the server's
own: each message is run on a real connection inside a transaction, and what
PostgreSQL did (the command tag of each statement it ran, and whether a
transaction is open afterwards) says whether it ended the transaction and went on.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from psycopg.pq import ExecStatus, TransactionStatus

from sa_fence._transaction_sql import (
    ends_transaction,
    might_leave_scope,
    scope_effect,
    statements,
)

#: Statements that run without error in any transaction (explicit or the implicit
#: one after a COMMIT in the same message), many of them lexically tricky.
STATEMENTS = [
    "SELECT 1",
    "SELECT ';'",
    "SELECT 'COMMIT; BEGIN'",
    "SELECT 'it''s; COMMIT'",
    "SELECT E'\\'; COMMIT; SELECT 1 --'",
    "SELECT '\\'",
    "SELECT $$;COMMIT;$$",
    "SELECT $t$ $$ ; COMMIT; $t$",
    "SELECT $_1$;END;$_1$",
    'SELECT 1 AS "x;COMMIT"',
    'SELECT 1 AS "a""; END"',
    "SELECT 1 /* ; COMMIT /* ; */ ; */",
    "SELECT 1 /* /* */ ; COMMIT ; SELECT 2 */",
    "/* /* */ */ COMMIT",
    "SELECT 1 -- ; COMMIT\n",
    "SELECT CASE WHEN true THEN 1 END",
    "SELECT 1 AS a$b$",
    "SELECT 1 AS commit",
    "SELECT U&'d\\0061t;a'",
    "(SELECT 1)",
    "SELECT (SELECT 1)",
    "VALUES (1), (2)",
    "COMMIT",
    "END",
    "ROLLBACK",
    "ABORT",
    "commit work",
    "END TRANSACTION",
    "/* c */ COMMIT",
    "COMMIT AND NO CHAIN",
    "BEGIN",
    "START TRANSACTION",
    "BEGIN ISOLATION LEVEL READ COMMITTED",
    "COMMIT AND CHAIN",
    "ROLLBACK AND CHAIN",
    "SAVEPOINT s; ROLLBACK TO SAVEPOINT s",
    "SAVEPOINT s; RELEASE s",
    "CREATE OR REPLACE FUNCTION pg_temp.sa_fence_b(begin int) RETURNS int LANGUAGE sql RETURN 1",
    "CREATE OR REPLACE FUNCTION pg_temp.sa_fence_probe() RETURNS int LANGUAGE sql "
    "BEGIN ATOMIC SELECT 1; SELECT CASE WHEN true THEN 2 END; END",
    "",
]
JOINS = [";", "; ", ";\n", " ; -- c;\n", ";/* ; */", "\t;"]

#: ROLLBACK TO's tag is ROLLBACK too: a statement after it counts (it may undo an arm).
ENDING_TAGS = {b"COMMIT", b"ROLLBACK", b"PREPARE TRANSACTION"}


@pytest.fixture(scope="module")
def raw(database_url: sa.URL) -> Iterator[psycopg.Connection]:
    url = database_url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET client_min_messages = error")  # BEGIN in a transaction warns
        yield conn


def server_leaves(conn: psycopg.Connection, sql: str, *, standard_strings: bool) -> bool | None:
    """Whether PostgreSQL, running ``sql`` as one message in a transaction, ended it (or
    rolled back to a savepoint) and ran more, or left another transaction open; ``None``
    when a statement failed (then the rest did not run)."""
    conn.execute(f"SET standard_conforming_strings = {'on' if standard_strings else 'off'}")
    conn.execute("SET escape_string_warning = off")
    conn.execute("BEGIN")
    xid = "SELECT pg_current_xact_id()::text"
    before = conn.execute(xid).fetchone()
    pgconn = conn.pgconn
    pgconn.send_query(sql.encode())
    tags: list[bytes] = []
    failed = False
    while (result := pgconn.get_result()) is not None:
        if result.status == ExecStatus.FATAL_ERROR:
            failed = True
        elif result.status in (ExecStatus.COMMAND_OK, ExecStatus.TUPLES_OK):
            tags.append(result.command_status or b"")
    if failed:
        conn.execute("ROLLBACK")
        return None
    # open in another transaction than the one it began in: chained (or begun again)
    moved = pgconn.transaction_status != TransactionStatus.IDLE and (
        conn.execute(xid).fetchone() != before
    )
    conn.execute("ROLLBACK")
    return any(tag in ENDING_TAGS for tag in tags[:-1]) or moved


messages = st.builds(
    lambda parts, joins, trailing: (
        "".join(
            part + (joins[i % len(joins)] if i < len(parts) - 1 else "")
            for i, part in enumerate(parts)
        )
        + trailing
    ),
    st.lists(st.sampled_from(STATEMENTS), min_size=1, max_size=5),
    st.lists(st.sampled_from(JOINS), min_size=1, max_size=4),
    st.sampled_from(["", ";", " -- end", ";\n"]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sql=messages, standard_strings=st.booleans())
@example(sql="COMMIT; BEGIN", standard_strings=True)
@example(sql="SELECT '\\'; COMMIT; SELECT ''", standard_strings=True)
@example(sql="SELECT '\\'; COMMIT; SELECT 1 --'", standard_strings=False)
def test_the_split_agrees_with_postgresql(
    raw: psycopg.Connection, sql: str, standard_strings: bool
) -> None:
    if any(scope_effect(sql)):  # the first look never hides what the split finds
        assert might_leave_scope(sql), sql
    server = server_leaves(raw, sql, standard_strings=standard_strings)
    assume(server is not None)
    assert scope_effect(sql, backslash_quotes=not standard_strings)[0] is server, sql


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("COMMIT; BEGIN", True),
        ("commit;insert into t values (1)", True),
        ("ROLLBACK; BEGIN", True),
        ("PREPARE TRANSACTION 'x'; BEGIN", True),
        ("END AND CHAIN", True),
        ("COMMIT", False),
        ("UPDATE t SET x = 1; COMMIT;", False),
        ("SELECT 1; SELECT 2", False),
        ("SAVEPOINT s; ROLLBACK TO SAVEPOINT s; SELECT 1", True),  # may undo an arm
        ("ROLLBACK WORK TO s; SELECT 1", True),
        ("SAVEPOINT s; ROLLBACK TRANSACTION TO s", False),
        ("SAVEPOINT s; RELEASE SAVEPOINT s; SELECT 1", False),
        ("COMMIT PREPARED 'x'; SELECT 1", False),  # not this transaction's end
        ("COMMIT AND NO CHAIN", False),
        # unterminated: the server refuses the message whole, so what follows never runs
        ("SELECT 'COMMIT; BEGIN", False),
        ("SELECT 1 /* COMMIT; BEGIN", False),
        ("SELECT 'a; COMMIT; BEGIN", False),
        ("SELECT E'a\\'; COMMIT; BEGIN", False),
        ('SELECT 1 AS "a; COMMIT; BEGIN', False),
        ("SELECT 1 /* a; COMMIT; BEGIN", False),
        ("SELECT 1 /* /* */ a; COMMIT; BEGIN", False),
        ("SELECT $$a; COMMIT; BEGIN", False),
        ("SELECT $q$a; COMMIT; BEGIN $$", False),
        # BEGIN ATOMIC bodies: a parameter or a function named "begin" opens none
        ("CREATE FUNCTION f(begin int) RETURNS int RETURN 1; COMMIT; SELECT 1", True),
        ("CREATE FUNCTION begin() RETURNS int RETURN 1; COMMIT; SELECT 1", True),
        # ... nor a parameter "begin" of a type named "atomic" (CREATE DOMAIN atomic ...)
        ("CREATE FUNCTION f(begin atomic) RETURNS int RETURN 1; COMMIT; SELECT 1", True),
        ("SELECT 1); COMMIT; BEGIN", True),  # a stray ")" hides no boundary
        (
            "CREATE PROCEDURE p() BEGIN ATOMIC SELECT CASE WHEN true THEN 1 END; END; SELECT 1",
            False,
        ),
    ],
)
def test_examples(sql: str, expected: bool) -> None:
    assert scope_effect(sql)[0] is expected


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("ROLLBACK TO SAVEPOINT s", True),
        ("rollback work to s", True),
        ("SELECT 1; ROLLBACK TRANSACTION TO SAVEPOINT s", True),
        ("ROLLBACK", False),
        ("ROLLBACK PREPARED 'x'", False),
        ("SELECT 'ROLLBACK TO s'", False),
        ("SELECT '\\'; ROLLBACK TO s; SELECT '", True),  # either reading of the backslash
    ],
)
def test_a_rollback_to_a_savepoint_is_found(sql: str, expected: bool) -> None:
    assert scope_effect(sql)[1] is expected


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("COMMIT", True),
        ("commit work", True),
        ("End", True),
        ("ABORT", True),
        ("ROLLBACK", True),
        ("PREPARE TRANSACTION 'x'", True),
        ("SELECT 1; COMMIT", True),
        ("COMMIT AND CHAIN", True),
        ("ROLLBACK TO SAVEPOINT s", False),
        ("COMMIT PREPARED 'x'", False),
        ("PREPARE q AS SELECT 1", False),
        ("SELECT 'COMMIT'", False),
        ("/* ROLLBACK */ SELECT 1", False),
        ('SELECT 1 AS "end"', False),
        ("SELECT '\\'; END; SELECT '", True),  # either reading of the backslash
    ],
)
def test_a_statement_that_ends_the_transaction_is_found(sql: str, expected: bool) -> None:
    """What pipeline mode refuses even alone (_scope): any end, not a ROLLBACK TO."""
    assert ends_transaction(sql) is expected


def test_a_backslash_read_either_way_is_refused_when_the_setting_is_unknown() -> None:
    """``'\\'`` ends a string with standard_conforming_strings on and not with it off:
    without knowing the server's setting, either reading that finds a COMMIT followed
    by a statement is enough."""
    on = "SELECT '\\'; COMMIT; SELECT 1 --'"  # on: three statements; off: one
    off = "SELECT 'a\\''; COMMIT; SELECT ''"  # off: three statements; on: one
    assert scope_effect(on, backslash_quotes=False)[0]
    assert not scope_effect(on, backslash_quotes=True)[0]
    assert scope_effect(off, backslash_quotes=True)[0]
    assert not scope_effect(off, backslash_quotes=False)[0]
    assert scope_effect(on)[0]
    assert scope_effect(off)[0]


def test_statements_are_split_at_top_level_semicolons_only() -> None:
    sql = (
        "CREATE RULE r AS ON INSERT TO t DO ALSO (INSERT INTO a VALUES (1); "
        "INSERT INTO b VALUES (2)); SELECT $q$;$q$; "
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END; END"
    )
    heads = [tokens[:2] for tokens in statements(sql)]
    assert heads == [["CREATE", "RULE"], ["SELECT", "'"], ["CREATE", "FUNCTION"], ["END"]]


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("UPDATE jobs SET result = 'x' WHERE jobs.id = %(id)s", False),
        ("SELECT 1;", True),
        ("Commit And Chain", True),
        ("rOlLbAcK tO SAVEPOINT s", True),
        ("SELECT chain_id FROM links", True),  # a second look (the split) finds nothing
    ],
)
def test_the_first_look_passes_only_what_cannot_leave_scope(sql: str, expected: bool) -> None:
    assert might_leave_scope(sql) is expected
    assert not any(scope_effect(sql)) or might_leave_scope(sql)
