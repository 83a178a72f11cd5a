"""What a grant checks before it hands a token out, on the real servers.

* The register only moves forward (docs/guarantees.md): a sequence set back
  (``setval``, a restore, a promoted replica) makes the grant refuse, rather
  than hand out a token some holder already has.
* The sequence stays fit after the first ``check()``: a sequence switched
  to ``CYCLE``, ``AS integer`` or a negative increment, or a register whose
  token default was pointed at another sequence, refuses the grant and
  writes nothing.
* Nothing on the search_path stands in for the register: a temporary table
  ``sa_fence_leases`` on the connection, or a table of that name in a schema
  earlier on the search_path, changes nothing of what the grant writes or
  ``Fencer.check()`` reports.

Each guard has its pair: the same test with the guard taken out of the grant
statement (or the schema pinning switched off) shows the bad outcome.  These
tests change the sequence, so each runs in a database of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.cli import main as cli
from sa_fence.db import fitness as _fitness
from sa_fence.db import register as _register
from sa_fence.db import tokens as _tokens
from sa_fence.testing import expire
from tests._fresh_db import fresh_database, url_of
from tests._tools import wait_for
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE, Base, Job


@pytest.fixture
def db() -> Iterator[sa.Engine]:
    with fresh_database("grant") as engine:
        Base.metadata.create_all(engine)
        yield engine


@pytest.fixture
def make_fencer(db: sa.Engine, redis_client: redis.Redis, key_prefix: str) -> Iterator[Any]:
    made: list[sa_fence.Fencer] = []

    def make(engine: sa.Engine | None = None) -> sa_fence.Fencer:
        fencer = sa_fence.Fencer(
            redis_client, engine or db, sequence=SEQUENCE, key_prefix=key_prefix
        )
        made.append(fencer)
        return fencer

    yield make
    for fencer in made:
        fencer.close()


def without(db: sa.Engine, monkeypatch: pytest.MonkeyPatch, *guards: str) -> None:
    """Take ``guards`` (pieces of the grant function) out of it in ``db``, for a pair test."""
    ddl = _register._GRANT_FUNCTION
    for guard in guards:
        assert guard in ddl, "the guard is no longer in the grant function"
        ddl = ddl.replace(guard, "")
    monkeypatch.setattr(_register, "_GRANT_FUNCTION", ddl)
    remake_functions(db)


def remake_functions(db: sa.Engine) -> None:
    """Make the register's functions again in ``db`` from the (patched) DDL."""
    with db.begin() as conn:
        conn.execute(sa.text(_register.check_function_sql(_register.Register(SEQUENCE))))


FORWARD_GUARD = "     WHERE r.token OPERATOR(pg_catalog.<) EXCLUDED.token\n"
#: A drawn token another name holds is not recorded (with the unique index on token).
CLASH_GUARD = (
    "     WHERE NOT EXISTS (SELECT FROM @sa_fence_schema@.sa_fence_leases o\n"
    "                        WHERE o.token OPERATOR(pg_catalog.=) m.token)\n"
)


def register_row(engine: sa.Engine, name: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT token, previous FROM public.sa_fence_leases WHERE name = :n"),
            {"n": name},
        ).one_or_none()


def last_value(engine: sa.Engine) -> tuple[int, bool]:
    with engine.connect() as conn:
        row = conn.execute(sa.text(f"SELECT last_value, is_called FROM {SEQUENCE}")).one()
        return int(row.last_value), bool(row.is_called)


def keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*"))


def execute(engine: sa.Engine, *statements: str) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(sa.text(statement))


def jobs(engine: sa.Engine) -> list[tuple[int, str | None]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT id, result FROM jobs ORDER BY id"))]


# ------------------------------------------------------------------ forward only


def stale_holder_then_setback(
    fencer: sa_fence.Fencer, db: sa.Engine, *, back: int = 0
) -> tuple[Any, Session]:
    """A holds job:1 and has written; A pauses past its TTL; then the sequence is set
    back so that its next value is A's own token (minus ``back``)."""
    make_session = sa_fence.install(sessionmaker(db))
    for _ in range(back):
        fencer.acquire("job:0", 5).release()
    a = fencer.acquire("job:1", 5)
    session = a.bind(make_session())
    session.add(Job(id=1, result="A (stale)"))
    session.flush()
    expire(a)
    execute(db, f"SELECT setval('{SEQUENCE}', {a.token - back}, false)")
    return a, session


def test_a_grant_whose_token_would_not_move_the_register_forward_is_refused(
    make_fencer: Any, db: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    fencer = make_fencer()
    a, session_a = stale_holder_then_setback(fencer, db)
    with pytest.raises(sa_fence.FencingConfigError) as refused:
        fencer.acquire("job:1", 5)
    message = str(refused.value)
    assert f"token sequence {SEQUENCE!r} is behind the lease register" in message
    assert f"it drew token {a.token}, but the register already holds token {a.token}" in message
    assert "sa-fence repair-sequence" in message
    assert keys(redis_client, key_prefix) == []  # the lease key was withdrawn
    assert register_row(db, "job:1").token == a.token  # the register did not move
    session_a.rollback()
    session_a.close()


def test_after_repair_sequence_a_grant_passes_the_register_and_fences_out_the_stale_holder(
    make_fencer: Any, db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    fencer = make_fencer()
    a, session_a = stale_holder_then_setback(fencer, db, back=3)
    status = cli.main(["check", "--url", url_of(db)])
    out = " ".join(capsys.readouterr().out.split())
    assert status == 1
    assert (
        f"is behind the rows: its last value is {a.token - 4} but max(token) of the lease "
        f"register sa_fence_leases is {a.token}." in out
    )
    with pytest.raises(sa_fence.FencingConfigError, match=f"drew token {a.token - 3}, but"):
        fencer.acquire("job:1", 5)
    assert cli.main(["repair-sequence", "--url", url_of(db), "--margin", "0", "--yes"]) == 0
    capsys.readouterr()
    b = fencer.acquire("job:1", 5)
    assert b.token > a.token
    with pytest.raises(sa_fence.StaleTokenError, match="commit refused"):
        session_a.commit()
    session_a.close()
    assert jobs(db) == []
    b.release()


def test_without_the_forward_only_guard_a_set_back_sequence_reissues_a_held_token(
    make_fencer: Any, db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair: without ``r.token < EXCLUDED.token`` B gets A's own token, and the
    stale A's commit lands over B's lease.  (The clash guard and the unique token index
    refuse a token the register holds for any name, this one too: they go as well.)"""
    without(db, monkeypatch, FORWARD_GUARD, CLASH_GUARD)
    execute(db, "DROP INDEX sa_fence_leases_token")
    fencer = make_fencer()
    a, session_a = stale_holder_then_setback(fencer, db)
    b = fencer.acquire("job:1", 5)
    assert b.token == a.token  # one token, two holders
    session_a.commit()  # the stale holder's write lands
    session_a.close()
    assert jobs(db) == [(1, "A (stale)")]
    b.release()


def test_check_reads_a_sequence_set_back_with_is_called_false_exactly(
    db: sa.Engine, make_fencer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``setval(seq, n, false)`` makes n the next token: behind a register holding n,
    not behind one holding n - 1."""
    fencer = make_fencer()
    token = fencer.acquire("job:1", 5).token
    fencer.acquire("job:2", 5)  # the sequence is past job:1's token
    execute(db, f"SELECT setval('{SEQUENCE}', {token + 2}, false)")  # next: token + 2
    cli.main(["check", "--url", url_of(db)])  # job:2 holds token + 1, below the next: fine
    out = " ".join(capsys.readouterr().out.split())
    assert "is behind the rows" not in out
    execute(db, f"SELECT setval('{SEQUENCE}', {token + 1}, false)")  # next: job:2's token
    cli.main(["check", "--url", url_of(db)])
    out = " ".join(capsys.readouterr().out.split())
    assert f"is behind the rows: its last value is {token}" in out


@pytest.mark.parametrize("had_a_row", [True, False], ids=["granted-before", "first-grant"])
def test_a_grant_overtaken_by_a_newer_grant_of_its_name_is_a_lost_lease_not_a_set_back_sequence(
    make_fencer: Any, db: sa.Engine, redis_client: redis.Redis, key_prefix: str, had_a_row: bool
) -> None:
    """A grant that drew its token, then waited on the register row while a newer
    grant of the name (drawn later, so larger) committed: its Redis lease had
    expired.  LeaseLostError, not the "sequence is behind" advice to stop the
    workers and repair the sequence (the pair: without the distinction the
    refusal is that FencingConfigError).  ``first-grant``: the newer grant's INSERT
    of the name's first row is in flight, so this grant's snapshot holds no row."""
    fencer = make_fencer()
    if had_a_row:
        fencer.acquire("job:1", 5).release()
    else:
        fencer.check()  # (the grant below is then the name's first)
    outcome: list[BaseException | sa_fence.Lease] = []
    with db.connect() as blocker:
        blocker.execute(
            sa.text("SELECT token FROM sa_fence_leases WHERE name = 'job:1' FOR UPDATE")
            if had_a_row
            else sa.text("INSERT INTO sa_fence_leases (name, token) VALUES ('job:1', 0)")
        )
        thread = threading.Thread(target=lambda: outcome.append(_acquire(fencer, "job:1")))
        thread.start()
        wait_for(lambda: _waiting_grants(db) > 0, 10, "the grant waiting on the register row")
        blocker.execute(
            sa.text(
                f"UPDATE sa_fence_leases SET previous = token, token = nextval('{SEQUENCE}') "
                "WHERE name = 'job:1'"
            )
        )
        blocker.commit()
        thread.join(10)
    (error,) = outcome
    assert isinstance(error, sa_fence.LeaseLostError), error
    drawn = register_row(db, "job:1").token - 1  # the blocker drew right after it
    assert (
        f"a newer grant of that name committed while this one (token {drawn}) was in flight"
        in str(error)
    )
    assert "repair-sequence" not in str(error)
    assert keys(redis_client, key_prefix) == []


def _acquire(fencer: sa_fence.Fencer, name: str) -> BaseException | sa_fence.Lease:
    try:
        return fencer.acquire(name, 30)
    except BaseException as exc:  # handed to the test thread
        return exc


def _waiting_grants(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE '%sa_fence_grant%'"
                )
            ).scalar_one()
        )


# --------------------------------------------------------- fitness at each grant

FITNESS = [
    pytest.param(
        [f"ALTER SEQUENCE {SEQUENCE} CYCLE"],
        "is_no_cycle",
        "it is CYCLE (need NO CYCLE",
        id="cycle",
    ),
    pytest.param(
        [f"ALTER SEQUENCE {SEQUENCE} AS integer"],
        "is_bigint",
        "its type is integer (need bigint",
        id="as-integer",
    ),
    pytest.param(
        [f"ALTER SEQUENCE {SEQUENCE} INCREMENT BY -1 MINVALUE -100"],
        "is_increasing",
        "it has INCREMENT -1 (need a positive increment)",
        id="negative-increment",
    ),
    pytest.param(
        [f"ALTER SEQUENCE {SEQUENCE} SET UNLOGGED"],
        "is_logged",
        "it is UNLOGGED or temporary (need a logged sequence: a crash resets",
        id="unlogged",
    ),
    pytest.param(
        [
            "CREATE SEQUENCE other_seq AS bigint CACHE 1 NO CYCLE START 1000",
            "ALTER TABLE sa_fence_leases ALTER COLUMN token SET DEFAULT nextval('other_seq')",
        ],
        None,  # the register's own sequence: cut out below
        "draws its tokens from sequence other_seq, not from sa_fence_token_seq: a Fencer "
        "naming sa_fence_token_seq is refused",
        id="default-from-another-sequence",
    ),
]


def without_default_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grant without its test that the sequence is the register's own."""
    grant = _register.grant_function_sql()
    assert (
        "s.seqrelid IN "
        + _fitness.token_sequences_sql("CAST(@sa_fence_register@ AS pg_catalog.regclass)")
        in grant
    ), "the register's sequence is no longer tested in the grant function"
    monkeypatch.setattr(_register, "token_sequences_sql", lambda register: "(s.seqrelid)")


def without_rule(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    """The grant without one rule of sa_fence.db.fitness.SEQUENCE_RULES (the one
    statement of it that the grant, Fencer.check() and sa-fence check read)."""
    assert _fitness.SEQUENCE_FIT_SQL in _register.grant_function_sql()
    kept = [rule.sql for rule in _fitness.SEQUENCE_RULES if rule.key != key]
    assert len(kept) == len(_fitness.SEQUENCE_RULES) - 1, f"no sequence rule {key!r}"
    monkeypatch.setattr(_register, "SEQUENCE_FIT_SQL", " AND ".join(kept))


@pytest.mark.parametrize(("alter", "guard", "problem"), FITNESS)
def test_a_sequence_made_unfit_after_the_first_check_refuses_the_grant_and_writes_nothing(
    make_fencer: Any,
    db: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
    alter: list[str],
    guard: str | None,
    problem: str,
) -> None:
    fencer = make_fencer()
    first = fencer.acquire("job:1", 5)  # checked, granted
    first.release()
    execute(db, *alter)
    before = last_value(db)
    with pytest.raises(sa_fence.FencingConfigError) as refused:
        fencer.acquire("job:1", 5)
    assert "lease 'job:1' was not granted" in str(refused.value)
    assert problem in str(refused.value)
    with pytest.raises(sa_fence.FencingConfigError, match="was not granted"):
        fencer.acquire("job:2", 5)  # a name never granted: no row is made
    assert last_value(db) == before  # no token was drawn
    assert register_row(db, "job:1") == (first.token, None)
    assert register_row(db, "job:2") is None
    assert keys(redis_client, key_prefix) == []


@pytest.mark.parametrize(("alter", "guard", "problem"), FITNESS)
def test_without_its_fitness_guard_the_unfit_sequence_grants(
    make_fencer: Any,
    db: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    alter: list[str],
    guard: str | None,
    problem: str,
) -> None:
    """The pair: the same change, the grant statement without that guard: granted."""
    if guard is None:
        without_default_check(monkeypatch)
    else:
        without_rule(monkeypatch, guard)
    remake_functions(db)
    fencer = make_fencer()
    fencer.acquire("job:1", 5).release()
    execute(db, *alter)
    lease = fencer.acquire("job:2", 5)  # granted on an unfit set-up
    assert register_row(db, "job:2").token == lease.token
    lease.release()


# ------------------------------------------------------------ no stand-ins on the search_path

SHADOW_LIKE = "(LIKE public.sa_fence_leases INCLUDING DEFAULTS INCLUDING INDEXES)"


def engine_with_temp_table(db: sa.Engine, definition: str) -> sa.Engine:
    """An engine each of whose connections has a ``TEMP TABLE sa_fence_leases``."""
    engine = sa.create_engine(db.url)

    @sa.event.listens_for(engine, "connect")
    def _stand_in(dbapi_conn: Any, record: Any) -> None:
        with dbapi_conn.cursor() as cursor:
            cursor.execute(f"CREATE TEMP TABLE sa_fence_leases {definition}")
        dbapi_conn.commit()

    return engine


@pytest.mark.parametrize("shadow", ["temp table", "schema earlier on the search_path"])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned (pair)"])
def test_a_table_named_like_the_register_on_the_search_path_changes_nothing_the_grant_writes(
    make_fencer: Any,
    db: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    shadow: str,
    pinned: bool,
) -> None:
    if not pinned:  # the pair: names resolved through the search_path, client and function
        monkeypatch.setattr(_register.Register, "pinned", lambda self, schema: self)
        # (the stand-in has no scope table beside it, which check() would refuse first)
        monkeypatch.setattr(_tokens, "scope_trigger_problem", lambda conn, register: None)
        # the grant function as it would be without its qualified names and pinned search_path
        without(db, monkeypatch, "@sa_fence_schema@.", "SET search_path = pg_catalog, pg_temp")
    if shadow == "temp table":
        engine = engine_with_temp_table(db, SHADOW_LIKE)
    else:
        execute(db, "CREATE SCHEMA shadow", f"CREATE TABLE shadow.sa_fence_leases {SHADOW_LIKE}")
        engine = sa.create_engine(db.url, connect_args={"options": "-c search_path=shadow,public"})
    try:
        fencer = make_fencer(engine)
        lease = fencer.acquire("job:1", 5)
        real = register_row(db, "job:1")
        if pinned:
            assert real is not None
            assert real.token == lease.token
        else:
            assert real is None  # the grant went to the stand-in
        if shadow != "temp table":
            with db.connect() as conn:
                shadowed = conn.execute(sa.text("SELECT token FROM shadow.sa_fence_leases"))
                assert shadowed.scalars().all() == ([] if pinned else [lease.token])
        lease.release()
        fencer.close()
    finally:
        engine.dispose()


def test_a_temp_sequence_named_like_the_token_sequence_is_never_the_one_pinned(
    make_fencer: Any, db: sa.Engine
) -> None:
    """With pg_temp named on the search_path (before public), a temporary sequence of the
    token sequence's name is found first by name; the pinning skips the session's own
    temporary schema, where any role can create a stand-in."""
    engine = sa.create_engine(db.url, connect_args={"options": "-c search_path=pg_temp,public"})

    @sa.event.listens_for(engine, "connect")
    def _stand_in(dbapi_conn: Any, record: Any) -> None:
        with dbapi_conn.cursor() as cursor:
            cursor.execute(f"CREATE TEMP SEQUENCE {SEQUENCE} CACHE 1")
        dbapi_conn.commit()

    try:
        fencer = make_fencer(engine)
        lease = fencer.acquire("job:1", 5)
        assert fencer.token_source.register.schema == "public"
        assert register_row(db, "job:1").token == lease.token
        lease.release()
        fencer.close()
    finally:
        engine.dispose()


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned (pair)"])
def test_a_temp_table_named_like_the_register_changes_nothing_fencer_check_reports(
    make_fencer: Any, db: sa.Engine, monkeypatch: pytest.MonkeyPatch, pinned: bool
) -> None:
    if not pinned:
        monkeypatch.setattr(_register.Register, "pinned", lambda self, schema: self)
    engine = engine_with_temp_table(db, "(name text)")  # the wrong shape
    try:
        fencer = make_fencer(engine)
        if pinned:
            fencer.check()  # the real register is fine
        else:
            with pytest.raises(sa_fence.FencingConfigError, match="has the wrong shape"):
                fencer.check()
    finally:
        engine.dispose()


async def test_the_async_front_end_refuses_a_grant_that_would_not_move_the_register_forward(
    make_fencer: Any, db: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    a, session_a = stale_holder_then_setback(make_fencer(), db)
    engine = create_async_engine(db.url.set(drivername="postgresql+psycopg_async"))
    aclient = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        afencer = sa_fence.AsyncFencer(aclient, engine, sequence=SEQUENCE, key_prefix=key_prefix)
        with pytest.raises(sa_fence.FencingConfigError, match=f"drew token {a.token}, but"):
            await afencer.acquire("job:1", 5)
        assert keys(redis_client, key_prefix) == []
        assert register_row(db, "job:1").token == a.token
    finally:
        await aclient.aclose()
        await engine.dispose()
        session_a.rollback()
        session_a.close()
