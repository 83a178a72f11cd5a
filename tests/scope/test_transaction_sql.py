"""SQL text that ends its transaction and goes on is found as PostgreSQL splits it.

The reading is PostgreSQL's own parser (pglast); these tests hold it to the server, on
hand-picked shapes, on hypothesis' examples and (slow) on 100,000 generated messages.

``sa_fence.scope.transaction_sql`` decides which ``text()``, driver SQL or DDL a bound
connection refuses (``COMMIT; BEGIN``, ``COMMIT; INSERT ...``, ``COMMIT AND CHAIN``:
what follows would run outside lease scope; tests/scope/test_scope_trigger.py has the
refusals and the guard-removal pair).  Here its verdict is held to the server's
own: each message is run on a real connection inside a transaction, and what
PostgreSQL did (the command tag of each statement it ran, and whether a
transaction is open afterwards) says whether it ended the transaction and went on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from psycopg.pq import ExecStatus, TransactionStatus

from sa_fence.scope.transaction_sql import (
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
    # the shapes a hand-written splitter read otherwise than PostgreSQL (issue 46)
    "SELECT 1 --\rCOMMIT",
    "--\rCOMMIT",
    "COMMIT AND --\rCHAIN",
    "COMMIT AND /* x */ CHAIN",
    "SELECT $€$'$€$",
    "SELECT $€$;COMMIT;$€$",
    "SELECT $é$ $$ ; COMMIT; $é$",
    "SELECT 1 AS €$a$",
    "SELECT 1\n€$a$",
    "SELECT 1 AS é$x",
    'SELECT 1 AS "€;COMMIT"',
    "SELECT E'\\\\'",
    "SELECT E'\\';COMMIT;'",
    "SELECT 1 AS x€",
    "ROLLBACK TRANSACTION TO SAVEPOINT s",
]
JOINS = [";", "; ", ";\n", " ; -- c;\n", ";/* ; */", "\t;", "; --\r", ";\r--x\r", ";/*\r*/"]

#: ROLLBACK TO's tag is ROLLBACK too: a statement after it counts (it may undo an arm).
ENDING_TAGS = {b"COMMIT", b"ROLLBACK", b"PREPARE TRANSACTION"}


@pytest.fixture(scope="module")
def raw(database_url: sa.URL) -> Iterator[psycopg.Connection]:
    url = database_url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET client_min_messages = error")  # BEGIN in a transaction warns
        yield conn


def server_leaves(conn: psycopg.Connection, sql: str) -> bool | None:
    """Whether PostgreSQL, running ``sql`` as one message in a transaction, ended it (or
    rolled back to a savepoint) and ran more, or left another transaction open; ``None``
    when a statement failed (then the rest did not run).  Two round trips: the transaction
    is begun (and its id read) in the message, before ``sql``'s own statements."""
    pgconn = conn.pgconn
    pgconn.send_query(b"BEGIN; SELECT pg_current_xact_id()::text; " + sql.encode())
    results: list[Any] = []
    failed = False
    while (result := pgconn.get_result()) is not None:
        if result.status == ExecStatus.FATAL_ERROR:
            failed = True
        elif result.status in (ExecStatus.COMMAND_OK, ExecStatus.TUPLES_OK):
            results.append(result)
    if failed or len(results) < 2:
        pgconn.exec_(b"ROLLBACK")
        return None
    before = results[1].get_value(0, 0)
    tags = [result.command_status or b"" for result in results[2:]]
    # open in another transaction than the one it began in: chained (or begun again)
    moved = False
    if pgconn.transaction_status != TransactionStatus.IDLE:
        pgconn.send_query(b"SELECT pg_current_xact_id()::text; ROLLBACK")
        after = []
        while (result := pgconn.get_result()) is not None:
            after.append(result)
        moved = after[0].get_value(0, 0) != before
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
@given(sql=messages)
@example(sql="COMMIT; BEGIN")
@example(sql="SELECT '\\'; COMMIT; SELECT ''")
@example(sql="SELECT 1; --\rCOMMIT; BEGIN")
@example(sql="SELECT $€$'$€$; COMMIT; BEGIN; SELECT 1 --'")
@example(sql="SELECT 1\n€$a$;SELECT 3")
def test_the_split_agrees_with_postgresql(raw: psycopg.Connection, sql: str) -> None:
    if any(scope_effect(sql)):  # the first look never hides what the split finds
        assert might_leave_scope(sql), sql
    server = server_leaves(raw, sql)
    assume(server is not None)
    assert scope_effect(sql)[0] is server, sql


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
        # with standard_conforming_strings on (off is refused, _scope): a string, then an
        # unterminated one the server refuses whole
        ("SELECT '\\'; ROLLBACK TO s; SELECT '", False),
        ("SELECT 1; --\rROLLBACK TO SAVEPOINT sp", True),
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
        ("SELECT '\\'; END; SELECT 'x'", True),  # standard_conforming_strings on
        ("--\rCOMMIT", True),
    ],
)
def test_a_statement_that_ends_the_transaction_is_found(sql: str, expected: bool) -> None:
    """What pipeline mode refuses even alone (_scope): any end, not a ROLLBACK TO."""
    assert ends_transaction(sql) is expected


def test_statements_are_split_at_top_level_semicolons_only() -> None:
    sql = (
        "CREATE RULE r AS ON INSERT TO t DO ALSO (INSERT INTO a VALUES (1); "
        "INSERT INTO b VALUES (2)); SELECT $q$;$q$; "
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END; END"
    )
    assert [s.kind for s in statements(sql)] == [None, None, None, "end"]


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1; --\rCOMMIT; BEGIN",
        "COMMIT AND --\rCHAIN",
        "SELECT $€$'$€$; COMMIT; BEGIN; SELECT 1 --'",
        "SELECT 1; --\rROLLBACK TO SAVEPOINT sp; SELECT 1",
    ],
)
def test_the_shapes_a_hand_written_splitter_missed_are_found(sql: str) -> None:
    """issue 46: a ``--`` comment ends at ``\\r`` too; a dollar-quote tag may hold any
    character past ASCII."""
    assert scope_effect(sql)[0]


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


# ------------------------------------------------ the differential fuzz: 100,000 messages

#: Characters whose place decides how PostgreSQL lexes a message.
_MUTATIONS = ["\r", "\n", "-", "--", "$", "€", "é", "'", '"', ";", "/*", "*/", "\\", "E", " "]


def generated_messages(count: int, seed: int) -> Iterator[str]:
    """``count`` messages of STATEMENTS joined by JOINS, half of them mutated at random
    places by the characters that decide how PostgreSQL lexes them."""
    rng = random.Random(seed)
    for _ in range(count):
        parts = [rng.choice(STATEMENTS) for _ in range(rng.randint(1, 5))]
        sql = "".join(part + rng.choice(JOINS) for part in parts[:-1]) + parts[-1]
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                at = rng.randint(0, len(sql))
                sql = sql[:at] + rng.choice(_MUTATIONS) + sql[at:]
        yield sql


def disagreements(
    conn: psycopg.Connection, reader: Callable[[str], bool], count: int, seed: int
) -> tuple[int, list[str]]:
    """(messages the server ran without error, the messages where ``reader`` and the server
    disagree on whether the transaction ended, or rolled back to a savepoint, and went on)."""
    compared, found = 0, []
    for sql in generated_messages(count, seed):
        server = server_leaves(conn, sql)
        if server is None:
            continue
        compared += 1
        if reader(sql) is not server:
            found.append(sql)
    return compared, found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_100000_generated_messages_find_no_disagreement_with_postgresql(
    raw: psycopg.Connection,
) -> None:
    """issue 46: sa-fence and PostgreSQL agree, on every message the server runs, on where a
    transaction ends or begins."""
    compared, found = disagreements(raw, lambda sql: scope_effect(sql)[0], 100_000, seed=46)
    assert found == []
    assert compared >= 30_000, "too few messages ran for the comparison to mean much"


def naive_leaves(sql: str) -> bool:
    """A reader of our own: statements split at every ';' (quotes and comments ignored)."""
    heads = [piece.split() for piece in sql.split(";") if piece.strip()]
    ends = {"COMMIT", "END", "ROLLBACK", "ABORT"}
    return any(
        head[0].upper() in ends and (i < len(heads) - 1 or "CHAIN" in sql.upper())
        for i, head in enumerate(heads)
    )


def test_the_fuzz_finds_a_reader_that_is_not_postgresqls(raw: psycopg.Connection) -> None:
    """The pair: the same comparison finds a hand-written reader's disagreements quickly."""
    compared, found = disagreements(raw, naive_leaves, 2_000, seed=46)
    assert compared > 500
    assert found, "the fuzz would not notice a reader that is not PostgreSQL's"
