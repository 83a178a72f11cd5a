"""Lease-scoped fencing on real PostgreSQL and Redis (docs/lease-scope.md; issue 9).

The row fence (``UPDATE ... AND fence <= :token``) refuses a stale holder's
write only to a row the newer holder has already written.  Lease scope closes
the rest: once a newer lease of a name is granted (its token committed to the
``sa_fence_leases`` register), no transaction of a session bound to an older
lease of that name commits anything.  Each hole of issue 9 has a named test
here, as does each false refusal fixed with it, and a stateful property test
checks the rule over random interleavings (with its guard-removed pair).

A stale holder is made the slow way (a short TTL and a stall of twice the
TTL) in a few tests, and with :func:`sa_fence.testing.expire` (the Redis key
gone, the worker unaware) everywhere else, so the file runs in seconds.

The schema (tests/models_scope.py) lives in its own fresh database.  A Fencer
naming a second sequence in the same database is refused:
tests/lease/test_config.py::test_a_fencer_naming_another_sequence_than_its_registers_is_refused.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import ObjectDeletedError

import sa_fence
from sa_fence.orm import rewrite as _rewrite
from sa_fence.scope import arming
from sa_fence.testing import expire
from tests import _scope_fixtures
from tests._fresh_db import fresh_database
from tests._sql import recorded_statements, seed
from tests.models_scope import (
    TABLES,
    Child,
    Job,
    Legacy,
    Outbox,
    Parent,
    SpecialJob,
    Tag,
    UrgentJob,
    job_tags,
)
from tests.orm.test_property import stored_token

jobs = Job.__table__
legacy = Legacy.__table__

FENCES_A_CALLER_MIGHT_SEND = [0, 2**63 - 1]


# ------------------------------------------------------------------ fixtures


# The scope database and its fixtures, shared with the other lease-scope module
# (module-scoped: each module gets a database of its own).
scope_engine = _scope_fixtures.scope_engine
_empty_tables = _scope_fixtures.empty_tables
fencer = _scope_fixtures.fencer
make_session = _scope_fixtures.make_session


@pytest.fixture
def statements(scope_engine: sa.Engine) -> Iterator[list[str]]:
    """Every SQL statement sent to the scope database while the test runs."""
    with recorded_statements(scope_engine) as sent:
        yield sent


# ------------------------------------------------------------------- helpers


def grant_to_another_holder(fencer: sa_fence.Fencer, a: sa_fence.Lease) -> sa_fence.Lease:
    """A's lease runs out (A does not notice) and B is granted the name: A is stale."""
    assert expire(a)
    b = fencer.acquire(a.name, 5)
    assert b.token > a.token
    return b


def write_as(lease: sa_fence.Lease, make_session: sessionmaker[Session], change: Any) -> None:
    """One bound session of ``lease`` makes ``change(session)`` and commits."""
    with make_session() as session:
        lease.bind(session)
        change(session)
        session.commit()


def written_since_by_another_name(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    change: Callable[[Session], Any],
    name: str = "job:1:report",
) -> tuple[sa_fence.Lease, sa_fence.Lease]:
    """A takes job:1, then a holder of another name makes ``change`` and releases: every row it
    wrote carries a fence newer than A's token (the row fence's case, not lease scope's)."""
    a = fencer.acquire("job:1", 5)
    with fencer.acquire(name, 5) as b:
        write_as(b, make_session, change)
    return a, b


def fetch(engine: sa.Engine, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql), params).all()]


def job_rows(engine: sa.Engine) -> dict[int, tuple[Any, int | None]]:
    return {i: (r, f) for i, r, f in fetch(engine, "SELECT id, result, fence FROM jobs")}


def tag_ids(engine: sa.Engine, job_id: int) -> list[int]:
    rows = fetch(engine, "SELECT tag_id FROM job_tags WHERE job_id = :j ORDER BY 1", j=job_id)
    return [tag for (tag,) in rows]


def outbox(engine: sa.Engine) -> list[str]:
    return [m for (m,) in fetch(engine, "SELECT message FROM outbox ORDER BY id")]


def register_token(engine: sa.Engine, name: str) -> int | None:
    rows = fetch(engine, "SELECT token FROM sa_fence_leases WHERE name = :n", n=name)
    return rows[0][0] if rows else None


def assert_refused_at_commit(
    error: sa_fence.StaleTokenError, stale: sa_fence.Lease, newer: sa_fence.Lease
) -> None:
    """The lease-scope refusal: at COMMIT, naming the lease, its token and the newest."""
    assert error.statement == "COMMIT"
    assert error.table is None
    assert error.lease_name == stale.name
    assert error.token == stale.token
    assert error.newest_token == newer.token
    assert "Nothing of this transaction was committed" in str(error)


# ----------------------------------------------- issue 9 (1): joined inheritance


def test_a_stale_holders_change_to_a_subclass_column_only_is_refused_and_bs_value_stays(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    a = fencer.acquire("job:1", 0.2)
    session_a = a.bind(make_session())
    session_a.get(SpecialJob, 1).detail = "A"  # only special_jobs changes
    time.sleep(0.4)  # A stalls past its TTL (2x)
    with fencer.acquire("job:1", 5) as b:
        write_as(b, make_session, lambda s: setattr(s.get(SpecialJob, 1), "detail", "B"))
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert refused.value.token == a.token
    assert fetch(
        scope_engine,
        "SELECT j.result, s.detail, j.fence FROM jobs j JOIN special_jobs s USING (id)",
    ) == [("initial", "B", b.token)]


def test_a_stale_holders_subclass_only_change_is_refused_at_commit_when_b_wrote_elsewhere(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed_token = seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    a = fencer.acquire("job:1", 5)
    session_a = a.bind(make_session())
    session_a.get(SpecialJob, 1).detail = "A"
    b = grant_to_another_holder(fencer, a)
    write_as(b, make_session, lambda s: s.add(Outbox(id=1, message="B started")))
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()  # the row fence passes (B never wrote the row): lease scope refuses
    session_a.close()
    assert_refused_at_commit(refused.value, a, b)
    assert fetch(
        scope_engine, "SELECT s.detail, j.fence FROM jobs j JOIN special_jobs s USING (id)"
    ) == [("initial", seed_token)]
    b.release()


@pytest.mark.parametrize("cls", [SpecialJob, UrgentJob], ids=["joined", "single-table under it"])
def test_without_lease_scope_a_subclass_only_change_is_still_refused_by_the_base_tables_fence(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    cls: type[SpecialJob],
) -> None:
    """The row-fence level: the flush bumps the base row's fence, so it is compared too;
    for a single-table subclass of the joined one as well (it writes special_jobs too)."""
    monkeypatch.setattr(arming, "enter_scope", lambda conn, lease: None)
    seed(fencer, make_session, cls(id=1, result="initial", detail="initial"))
    a = fencer.acquire("job:1", 5)
    session_a = a.bind(make_session())
    session_a.get(cls, 1).detail = "A"
    b = grant_to_another_holder(fencer, a)
    write_as(b, make_session, lambda s: setattr(s.get(cls, 1), "detail", "B"))
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert refused.value.statement == "UPDATE"
    assert refused.value.table == "jobs"
    assert refused.value.primary_keys == ((1,),)
    assert refused.value.current_fences == (b.token,)
    assert fetch(scope_engine, "SELECT detail FROM special_jobs") == [("B",)]
    b.release()


def test_a_subclass_only_change_sets_the_base_rows_fence_to_the_writers_token(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed_token = seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        assert lease.token > seed_token
        lease.bind(session)
        job = session.get(SpecialJob, 1)
        job.detail = "mine"
        session.flush()
        assert job.fence == lease.token  # obj.fence reads the token, not the flagged value
        session.commit()
    assert fetch(
        scope_engine, "SELECT j.fence, s.detail FROM jobs j JOIN special_jobs s USING (id)"
    ) == [(lease.token, "mine")]


def test_a_subclass_only_change_after_a_base_column_flush_in_one_transaction_bumps_the_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """After a base-column UPDATE the fence attribute is expired (server_onupdate);
    a later subclass-only change in the same transaction must still bump it."""
    seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        job = session.get(SpecialJob, 1)
        job.detail = "first"
        session.flush()
        assert job.fence == lease.token
        job.result = "base"
        session.flush()  # fence expired here, reloaded on access
        job.detail = "second"
        session.flush()
        assert job.fence == lease.token
        session.commit()
    assert fetch(
        scope_engine,
        "SELECT j.result, j.fence, s.detail FROM jobs j JOIN special_jobs s USING (id)",
    ) == [("base", lease.token, "second")]


special_jobs = SpecialJob.__table__

#: Writes of a joined subclass's own table outside a flush, keyed by primary key (the ORM's bulk
#: UPDATE by primary key, its legacy bulk method, Core executemany), each as
#: change(session, detail); "base columns" and "both tables" are the ORM's bulk UPDATE of
#: SpecialJob writing jobs (the base table) alone, or jobs and special_jobs.
KEYED_SUBCLASS_WRITES: dict[str, Callable[[Session, str], Any]] = {
    "orm bulk by key": lambda s, v: s.execute(update(SpecialJob), [{"id": 1, "detail": v}]),
    "orm bulk by key, base columns": lambda s, v: s.execute(
        update(SpecialJob), [{"id": 1, "result": v}]
    ),
    "orm bulk by key, both tables": lambda s, v: s.execute(
        update(SpecialJob), [{"id": 1, "result": v, "detail": v}]
    ),
    "orm bulk by key, single-table under it": lambda s, v: s.execute(
        update(UrgentJob), [{"id": 1, "detail": v}]
    ),
    "bulk_update_mappings": lambda s, v: s.bulk_update_mappings(
        SpecialJob, [{"id": 1, "detail": v}]
    ),
    "core executemany": lambda s, v: s.execute(
        special_jobs.update()
        .where(special_jobs.c.id == bindparam("key"))
        .values(detail=bindparam("value")),
        [{"key": 1, "value": v}],
    ),
}


def subclass_row(engine: sa.Engine) -> list[tuple[Any, ...]]:
    return fetch(
        engine, "SELECT j.result, s.detail, j.fence FROM jobs j JOIN special_jobs s USING (id)"
    )


@pytest.mark.parametrize("write", list(KEYED_SUBCLASS_WRITES))
def test_a_stale_keyed_write_of_a_joined_subclass_outside_a_flush_is_refused_by_the_base_fence(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    write: str,
) -> None:
    """The row-fence level (lease scope skipped): a holder of another name wrote the row, so A's
    write is refused whichever table of the row it touches, and nothing of it is written."""
    monkeypatch.setattr(arming, "enter_scope", lambda conn, lease: None)
    cls = UrgentJob if "single-table" in write else SpecialJob
    seed(fencer, make_session, cls(id=1, result="initial", detail="initial"))
    a, b = written_since_by_another_name(
        fencer, make_session, lambda s: setattr(s.get(cls, 1), "detail", "B")
    )
    with make_session() as session:
        a.bind(session)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            KEYED_SUBCLASS_WRITES[write](session, "A")
    assert refused.value.table == "jobs"
    assert refused.value.primary_keys == ((1,),)
    assert refused.value.current_fences == (b.token,)
    assert subclass_row(scope_engine) == [("initial", "B", b.token)]
    a.release()


def test_inside_fence_connection_a_keyed_write_of_a_joined_subclass_table_is_compared(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """A Core connection has no session (no flush to tell apart): the base rows are compared."""
    seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    a, b = written_since_by_another_name(
        fencer, make_session, lambda s: setattr(s.get(SpecialJob, 1), "detail", "B")
    )
    keyed = special_jobs.update().where(special_jobs.c.id == bindparam("key")).values(detail="A")
    with scope_engine.connect() as conn, sa_fence.fence_connection(conn, a):
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            conn.execute(keyed, [{"key": 1}])
        conn.rollback()
    assert refused.value.table == "jobs"
    assert refused.value.current_fences == (b.token,)
    assert subclass_row(scope_engine) == [("initial", "B", b.token)]
    a.release()


@pytest.mark.parametrize("write", list(KEYED_SUBCLASS_WRITES))
def test_a_keyed_write_of_a_joined_subclass_outside_a_flush_advances_the_base_rows_fence(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    write: str,
) -> None:
    seed_token = seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    with fencer.acquire("job:1", 5) as lease:
        write_as(lease, make_session, lambda s: KEYED_SUBCLASS_WRITES[write](s, "mine"))
    assert lease.token > seed_token
    (result, detail, fence), *_ = subclass_row(scope_engine)
    assert fence == lease.token
    assert "mine" in (result, detail)


def test_a_bulk_method_after_a_flush_whose_context_is_kept_still_compares_the_base_rows(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """A bulk method sets the session's ``_flushing`` as the unit of work does; only the flush
    whose transaction is running skips the base bump, not one a listener kept a reference to."""
    seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    a, b = written_since_by_another_name(
        fencer, make_session, lambda s: setattr(s.get(SpecialJob, 1), "detail", "B")
    )
    kept: list[Any] = []
    with make_session() as session:
        a.bind(session)
        sa.event.listen(session, "after_flush", lambda s, context: kept.append(context))
        session.add(Outbox(id=1, message="a flush of its own"))
        session.flush()
        assert kept
        with pytest.raises(sa_fence.StaleTokenError):
            session.bulk_update_mappings(SpecialJob, [{"id": 1, "detail": "A"}])
    assert subclass_row(scope_engine) == [("initial", "B", b.token)]
    a.release()


def _keyed_subclass_write(connection: sa.Connection) -> None:
    keyed = special_jobs.update().where(special_jobs.c.id == bindparam("key")).values(detail="A")
    connection.execute(keyed, [{"key": 1}])


def _write_after_flush(session: Session, context: Any) -> None:
    _keyed_subclass_write(session.connection())


def _write_after_insert(mapper: Any, connection: sa.Connection, target: Any) -> None:
    _keyed_subclass_write(connection)


def _orm_bulk_after_flush(session: Session, context: Any) -> None:
    with warnings.catch_warnings():  # SQLAlchemy warns of Session.execute() inside a flush
        warnings.simplefilter("ignore", sa.exc.SAWarning)
        session.execute(update(SpecialJob), [{"id": 1, "detail": "A"}])


def _bulk_mappings_after_flush(session: Session, context: Any) -> None:
    session.bulk_update_mappings(SpecialJob, [{"id": 1, "detail": "A"}])


#: Listeners that send a keyed write of special_jobs while a flush of an Outbox row runs:
#: (what listens, given the session; the event; the listener).
DURING_A_FLUSH: dict[str, tuple[Callable[[Session], Any], str, Callable[..., None]]] = {
    "after_flush": (lambda session: session, "after_flush", _write_after_flush),
    "mapper after_insert": (lambda session: Outbox, "after_insert", _write_after_insert),
    "orm bulk by key": (lambda session: session, "after_flush", _orm_bulk_after_flush),
    "bulk_update_mappings": (lambda session: session, "after_flush", _bulk_mappings_after_flush),
}


@pytest.mark.parametrize("listener", list(DURING_A_FLUSH))
def test_a_keyed_write_a_listener_sends_during_a_flush_compares_the_base_rows(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    listener: str,
) -> None:
    """A statement a flush event or a mapper event sends while the flush runs is not one of the
    flush's own, whose rows the unit of work compares itself: its base rows are compared first."""
    seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    a, b = written_since_by_another_name(
        fencer, make_session, lambda s: setattr(s.get(SpecialJob, 1), "detail", "B")
    )
    target_of, event_name, listen = DURING_A_FLUSH[listener]
    with make_session() as session:
        a.bind(session)
        target = target_of(session)
        sa.event.listen(target, event_name, listen)
        try:
            session.add(Outbox(id=1, message="a flush of its own"))
            with pytest.raises(sa_fence.StaleTokenError) as refused:
                session.flush()
        finally:
            sa.event.remove(target, event_name, listen)
    assert refused.value.table == "jobs"
    assert refused.value.current_fences == (b.token,)
    assert subclass_row(scope_engine) == [("initial", "B", b.token)]
    a.release()


def _detached_special_job(make_session: sessionmaker[Session]) -> SpecialJob:
    with make_session() as reader:
        detached = reader.get(SpecialJob, 1)
        assert detached is not None
    detached.detail = "merged"  # only special_jobs changes
    return detached


def test_merge_of_a_detached_joined_subclass_by_a_stale_holder_is_refused_by_the_base_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """merge() copies the change onto the persistent object: the flush bumps its base row."""
    seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    detached = _detached_special_job(make_session)
    a, b = written_since_by_another_name(
        fencer, make_session, lambda s: setattr(s.get(SpecialJob, 1), "detail", "B")
    )
    with make_session() as session:
        a.bind(session)
        session.merge(detached)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            session.flush()
    assert refused.value.table == "jobs"
    assert subclass_row(scope_engine) == [("initial", "B", b.token)]
    a.release()


def test_merge_of_a_detached_joined_subclass_by_the_current_holder_advances_the_base_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed_token = seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    detached = _detached_special_job(make_session)
    with fencer.acquire("job:1", 5) as lease:
        write_as(lease, make_session, lambda s: s.merge(detached))
    assert lease.token > seed_token
    assert subclass_row(scope_engine) == [("initial", "merged", lease.token)]


def test_a_keyed_subclass_write_in_a_savepoint_rolls_back_with_its_base_rows_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """The base rows' fenced UPDATE is sent in the savepoint the write is in: rolling the
    savepoint back undoes both, and the rest of the transaction commits."""
    seed_token = seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Outbox(id=1, message="kept"))
        savepoint = session.begin_nested()
        KEYED_SUBCLASS_WRITES["core executemany"](session, "undone")
        savepoint.rollback()
        session.commit()
    assert subclass_row(scope_engine) == [("initial", "initial", seed_token)]
    assert outbox(scope_engine) == ["kept"]


def test_a_stale_keyed_subclass_write_in_a_savepoint_leaves_the_session_unable_to_commit(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """Rolling back the savepoint a stale write was refused in does not make the transaction
    fit to commit: a stale holder's other writes are refused too."""
    seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    a, b = written_since_by_another_name(
        fencer, make_session, lambda s: setattr(s.get(SpecialJob, 1), "detail", "B")
    )
    with make_session() as session:
        a.bind(session)
        session.add(Outbox(id=1, message="from the stale holder"))
        savepoint = session.begin_nested()
        with pytest.raises(sa_fence.StaleTokenError):
            KEYED_SUBCLASS_WRITES["core executemany"](session, "A")
        savepoint.rollback()
        with pytest.raises(sa_fence.FenceError, match="may not commit any part"):
            session.commit()
    assert subclass_row(scope_engine) == [("initial", "B", b.token)]
    assert outbox(scope_engine) == []
    a.release()


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.get(SpecialJob, 1).__setattr__("detail", "mine"),
        lambda s: s.get(SpecialJob, 1).__setattr__("result", "mine"),
        lambda s: s.delete(s.get(SpecialJob, 1)),
    ],
    ids=["subclass column", "base column", "delete"],
)
def test_a_flush_of_a_joined_subclass_sends_no_second_base_row_update(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    statements: list[str],
    change: Callable[[Session], Any],
) -> None:
    """The flush compares the base row itself (the bump, or the base table's DELETE): the
    statement hook adds no UPDATE of its own to the unit of work's statements."""
    seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    statements.clear()
    with fencer.acquire("job:1", 5) as lease:
        write_as(lease, make_session, change)
    writes = [s for s in statements if s.startswith(("UPDATE jobs", "DELETE FROM jobs"))]
    assert len(writes) == 1, statements


@pytest.mark.parametrize(
    "write",
    [
        lambda s: s.execute(update(SpecialJob).where(SpecialJob.id == 1).values(detail="A")),
        lambda s: s.execute(
            update(SpecialJob)
            .where(SpecialJob.detail == "initial")
            .values(detail="A")
            .execution_options(synchronize_session=False)
        ),
        lambda s: s.execute(sa.delete(SpecialJob).where(SpecialJob.id == 1)),
        lambda s: s.execute(special_jobs.update().where(special_jobs.c.id == 1).values(detail="A")),
        lambda s: s.execute(special_jobs.delete().where(special_jobs.c.detail == "initial")),
    ],
    ids=["orm update", "orm update, no sync", "orm delete", "core update", "core delete"],
)
def test_an_unkeyed_write_of_a_joined_subclass_table_is_refused_before_it_is_sent(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
    write: Callable[[Session], Any],
) -> None:
    """Its base rows could not be compared in the same statement (PostgreSQL's UPDATE writes
    one table), so it is refused with the way out, before anything is written."""
    seed_token = seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    statements.clear()
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        with pytest.raises(sa_fence.FencingConfigError) as refused:
            write(session)
        with pytest.raises(sa_fence.FenceError):
            session.commit()  # the session may not commit any part of it
    message = str(refused.value)
    assert "'special_jobs'" in message
    assert "jobs.fence" in message
    assert "by primary key" in message
    assert "Nothing was sent" in message
    assert not [s for s in statements if s.startswith(("UPDATE", "DELETE"))]
    assert subclass_row(scope_engine) == [("initial", "initial", seed_token)]


_special = special_jobs.alias("s")
_tags = job_tags.alias("t")

#: Writes of a joined subclass's own table through an alias or in a CTE: the hook does not
#: rewrite them, so their base rows could not be compared first (tests/orm/test_fenced_flush.py
#: has the same for a fence table).
SUBCLASS_UNREWRITABLE: dict[str, Callable[[Session], Any]] = {
    "alias, keyed": lambda s: s.execute(
        update(_special).where(_special.c.id == sa.bindparam("k")).values(detail="A"), {"k": 1}
    ),
    "update cte": lambda s: s.execute(
        select(
            special_jobs.update()
            .where(special_jobs.c.id == 1)
            .values(detail="A")
            .returning(special_jobs.c.id)
            .cte("u")
        )
    ),
}


@pytest.mark.parametrize("write", SUBCLASS_UNREWRITABLE.values(), ids=SUBCLASS_UNREWRITABLE.keys())
def test_a_write_of_a_joined_subclass_table_through_an_alias_or_in_a_cte_is_refused(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
    write: Callable[[Session], Any],
) -> None:
    seed_token = seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    statements.clear()
    unfenced = pytest.raises(sa_fence.UnfencedWriteError, match="fenced table 'special_jobs'")
    with make_session() as session, unfenced:
        write(session)
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        with pytest.raises(sa_fence.FencingConfigError, match="fenced table 'special_jobs'"):
            write(session)
    assert not [s for s in statements if "special_jobs" in s and "UPDATE" in s]
    assert subclass_row(scope_engine) == [("initial", "initial", seed_token)]


def test_without_a_lease_an_association_row_through_an_alias_or_in_a_cte_is_refused(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
) -> None:
    """As the association table's own statement: a lease is needed (and, bound, enough)."""
    seed(fencer, make_session, Job(id=1, result="initial"), Tag(id=1, label="one"))
    writes = [
        lambda s: s.execute(sa.delete(_tags).where(_tags.c.job_id == 1)),
        lambda s: s.execute(
            select(job_tags.insert().values(job_id=1, tag_id=1).returning(job_tags.c.tag_id).cte())
        ),
    ]
    statements.clear()
    for write in writes:
        with make_session() as session, pytest.raises(sa_fence.UnfencedWriteError):
            write(session)
    assert not [s for s in statements if "job_tags" in s]
    with fencer.acquire("job:1", 5) as lease, lease.bind(make_session()) as session:
        for write in reversed(writes):
            write(session)
        session.commit()
    assert tag_ids(scope_engine, 1) == []


#: A keyed UPDATE of jobs 1 and 2 with a condition of its own (result is one of ...), as
#: send(session, results): the ORM's bulk UPDATE by primary key with WHERE criteria, and Core.
KEYED_WITH_CRITERIA: dict[str, Callable[[Session, list[str]], Any]] = {
    "orm bulk by key": lambda s, results: s.execute(
        update(Job)
        .where(sa.or_(*(Job.result == r for r in results)))
        .execution_options(synchronize_session=None),
        [{"id": 1, "result": "x"}, {"id": 2, "result": "y"}],
    ),
    "core executemany": lambda s, results: s.execute(
        jobs.update()
        .where(jobs.c.id == bindparam("key"), sa.or_(*(jobs.c.result == r for r in results)))
        .values(result=bindparam("value")),
        [{"key": 1, "value": "x"}, {"key": 2, "value": "y"}],
    ),
}


@pytest.mark.parametrize("send", list(KEYED_WITH_CRITERIA))
def test_a_keyed_update_whose_own_criteria_skip_a_row_is_not_refused(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    send: str,
) -> None:
    """Its WHERE clause skips job 2 (SQLAlchemy counts no rows then): not a stale row."""
    seed_token = seed(fencer, make_session, Job(id=1, result="initial"), Job(id=2, result="2"))
    with fencer.acquire("job:1", 5) as lease:
        write_as(lease, make_session, lambda s: KEYED_WITH_CRITERIA[send](s, ["initial"]))
    assert job_rows(scope_engine) == {1: ("x", lease.token), 2: ("2", seed_token)}


@pytest.mark.parametrize("send", list(KEYED_WITH_CRITERIA))
def test_a_keyed_update_with_criteria_of_its_own_still_refuses_a_stale_row(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    send: str,
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"), Job(id=2, result="2"))
    a, b = written_since_by_another_name(
        fencer, make_session, lambda s: setattr(s.get(Job, 2), "result", "B"), "job:2"
    )
    with make_session() as session:
        a.bind(session)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            KEYED_WITH_CRITERIA[send](session, ["initial", "B"])
    assert refused.value.primary_keys == ((2,),)
    assert refused.value.current_fences == (b.token,)
    a.release()


def test_a_keyed_core_write_missing_a_key_value_is_refused_by_sqlalchemy_before_anything(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
) -> None:
    """A parameter set without the key's value: SQLAlchemy's own error, and nothing is sent
    (neither the base rows' UPDATE nor the statement)."""
    seed_token = seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    statements.clear()
    keyed = special_jobs.update().where(special_jobs.c.id == bindparam("key")).values(detail="A")
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        with pytest.raises(sa.exc.StatementError, match="A value is required for bind parameter"):
            session.execute(keyed, [{"key": 1}, {"other": 2}])
    assert not [s for s in statements if s.startswith(("UPDATE", "DELETE"))]
    assert subclass_row(scope_engine) == [("initial", "initial", seed_token)]


NEW_SPECIAL_JOB = {"id": 1, "result": "r", "detail": "d"}


@pytest.mark.parametrize(
    "insert",
    [
        lambda s: s.execute(sa.insert(SpecialJob), [NEW_SPECIAL_JOB]),
        lambda s: s.scalars(sa.insert(SpecialJob).returning(SpecialJob), [NEW_SPECIAL_JOB]).all(),
        lambda s: s.bulk_insert_mappings(SpecialJob, [NEW_SPECIAL_JOB]),
        lambda s: s.bulk_save_objects([SpecialJob(**NEW_SPECIAL_JOB)]),
    ],
    ids=["orm insert", "orm insert returning", "bulk_insert_mappings", "bulk_save_objects"],
)
def test_a_bulk_insert_of_a_joined_subclass_writes_the_token_as_the_base_rows_fence(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    insert: Callable[[Session], Any],
) -> None:
    """The ORM's bulk INSERT writes each table of the hierarchy with the entity's statement:
    the base table's row gets the token, not the column's default."""
    with fencer.acquire("job:1", 5) as lease:
        write_as(lease, make_session, insert)
    assert subclass_row(scope_engine) == [("r", "d", lease.token)]


@pytest.mark.parametrize(
    "write",
    [
        lambda s: s.execute(update(SpecialJob).where(SpecialJob.id == 1).values(detail="A")),
        lambda s: s.execute(update(SpecialJob), [{"id": 1, "detail": "A"}]),
        lambda s: s.execute(special_jobs.update().where(special_jobs.c.id == 1).values(detail="A")),
    ],
    ids=["orm update", "orm bulk by key", "core update"],
)
def test_without_a_lease_a_write_of_a_joined_subclass_table_is_refused_and_unfenced_lets_it(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    write: Callable[[Session], Any],
) -> None:
    seed_token = seed(fencer, make_session, SpecialJob(id=1, result="initial", detail="initial"))
    with make_session() as session:
        with pytest.raises(sa_fence.UnfencedWriteError):
            write(session)
        session.rollback()
        with sa_fence.unfenced(session):
            write(session)
        session.commit()
    assert subclass_row(scope_engine) == [("initial", "A", seed_token)]


# ------------------------------------------------ issue 9 (2): many-to-many


@pytest.mark.parametrize("change", ["append", "remove"])
def test_a_stale_holders_many_to_many_change_is_refused_and_the_association_rows_stay(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    change: str,
) -> None:
    one, two = Tag(id=1, label="one"), Tag(id=2, label="two")
    seed(fencer, make_session, Job(id=1, result="initial", tags=[one]), two)
    a = fencer.acquire("job:1", 5)
    session_a = a.bind(make_session())
    job = session_a.get(Job, 1)
    tags = job.tags  # loaded now: nothing is sent later until the commit
    if change == "append":
        tags.append(session_a.get(Tag, 2))
    else:
        tags.remove(session_a.get(Tag, 1))
    b = grant_to_another_holder(fencer, a)
    write_as(b, make_session, lambda s: setattr(s.get(Job, 1), "result", "B"))
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert_refused_at_commit(refused.value, a, b)
    assert tag_ids(scope_engine, 1) == [1]
    assert job_rows(scope_engine) == {1: ("B", b.token)}
    b.release()


def test_without_a_lease_an_append_to_a_fenced_entitys_collection_raises_unfenced_write_error(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"), Tag(id=1, label="one"))
    statements.clear()
    with make_session() as session:
        job = session.get(Job, 1)
        job.tags.append(session.get(Tag, 1))
        with pytest.raises(sa_fence.UnfencedWriteError, match=r"lease\.bind\(session\)"):
            session.commit()
    assert not [s for s in statements if "job_tags" in s and s.lstrip().startswith("INSERT")]
    assert tag_ids(scope_engine, 1) == []


def test_a_core_insert_into_the_association_table_through_an_unbound_session_is_refused(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"), Tag(id=1, label="one"))
    statements.clear()
    with make_session() as session:
        with pytest.raises(sa_fence.UnfencedWriteError):
            session.execute(job_tags.insert().values(job_id=1, tag_id=1))
        session.rollback()
    assert not [s for s in statements if s.lstrip().startswith("INSERT")]
    assert tag_ids(scope_engine, 1) == []


# ------------------------------------------------------- issue 9 (3): INSERT


def test_a_stale_holder_re_creating_a_row_the_newer_holder_deleted_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    a = fencer.acquire("job:1", 0.2)
    session_a = a.bind(make_session())
    time.sleep(0.4)  # A stalls past its TTL (2x)
    with fencer.acquire("job:1", 5) as b:
        write_as(b, make_session, lambda s: s.delete(s.get(Job, 1)))
    session_a.add(Job(id=1, result="A"))  # A still believes job 1 is its to write
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert_refused_at_commit(refused.value, a, b)
    assert job_rows(scope_engine) == {}


@pytest.mark.parametrize("via", ["orm", "raw-sql", "fence-connection"])
def test_a_stale_holders_insert_into_an_unfenced_table_is_refused(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    via: str,
) -> None:
    a = fencer.acquire("job:1", 5)
    b = grant_to_another_holder(fencer, a)

    def a_reports_job_1_done() -> None:
        if via == "fence-connection":
            with scope_engine.connect() as conn, sa_fence.fence_connection(conn, a):
                conn.execute(Outbox.__table__.insert().values(id=1, message="A: job 1 done"))
                conn.commit()
            return
        with make_session() as session_a:
            a.bind(session_a)
            if via == "orm":
                session_a.add(Outbox(id=1, message="A: job 1 done"))
            else:
                session_a.execute(
                    sa.text("INSERT INTO outbox (id, message) VALUES (1, 'A: job 1 done')")
                )
            session_a.commit()

    with pytest.raises(sa_fence.StaleTokenError) as refused:
        a_reports_job_1_done()
    assert_refused_at_commit(refused.value, a, b)
    assert outbox(scope_engine) == []
    b.release()


def test_a_raw_writer_that_checks_its_lease_before_commit_is_lease_scoped_too(
    fencer: sa_fence.Fencer, scope_engine: sa.Engine
) -> None:
    """Outside sa-fence, ``SELECT sa_fence_check_lease(name, token)`` before
    COMMIT gives a raw writer what a bound session has: its transaction commits
    nothing once a newer lease of the name was granted (migrations guide)."""
    import psycopg

    from sa_fence.cli.bench import psycopg_conninfo

    def raw() -> psycopg.Connection[Any]:  # another service, psql: not sa-fence
        return psycopg.connect(psycopg_conninfo(scope_engine.url))

    a = fencer.acquire("job:1", 5)
    check = "SELECT sa_fence_check_lease(%s, %s)"
    with raw() as conn:  # the current holder: commits
        conn.execute("INSERT INTO outbox (id, message) VALUES (1, 'A: first')")
        conn.execute(check, (a.name, a.token))
        conn.commit()
    b = grant_to_another_holder(fencer, a)
    with raw() as conn:  # A, stale now: refused, nothing committed
        conn.execute("INSERT INTO outbox (id, message) VALUES (2, 'A: late')")
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(check, (a.name, a.token))
        conn.rollback()
    assert refused.value.sqlstate == "SF003"
    assert outbox(scope_engine) == ["A: first"]
    with raw() as conn:  # the pair: without the check, the stale write lands
        conn.execute("INSERT INTO outbox (id, message) VALUES (2, 'A: late')")
        conn.commit()
    assert outbox(scope_engine) == ["A: first", "A: late"]
    b.release()


def test_a_write_flushed_before_the_newer_grant_but_committed_after_it_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """Only what the older holder *committed* before the grant stands."""
    seed_token = seed(fencer, make_session, Job(id=1, result="initial"))
    a = fencer.acquire("job:1", 5)
    session_a = a.bind(make_session())
    session_a.get(Job, 1).result = "A"
    session_a.add(Outbox(id=1, message="A"))
    session_a.flush()  # sent, row locked, not committed
    b = grant_to_another_holder(fencer, a)  # the grant does not wait for A's open transaction
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert_refused_at_commit(refused.value, a, b)
    assert job_rows(scope_engine) == {1: ("initial", seed_token)}
    assert outbox(scope_engine) == []
    b.release()


def test_a_session_on_another_engine_for_the_same_database_is_still_lease_scoped(
    fencer: sa_fence.Fencer, scope_engine: sa.Engine
) -> None:
    """The same database reached through another spelling of its host (localhost for
    127.0.0.1, as a second service's configuration may have it) is still the register's
    database: a stale holder's transaction there must not commit either."""
    host = scope_engine.url.host
    alias = "localhost" if host in ("127.0.0.1", "::1") else "127.0.0.1"
    other = sa.create_engine(scope_engine.url.set(host=alias))
    try:
        make_other_session = sa_fence.install(sessionmaker(other))
        a = fencer.acquire("job:1", 5)
        session_a = a.bind(make_other_session())
        b = grant_to_another_holder(fencer, a)
        session_a.add(Outbox(id=1, message="A: job 1 done"))
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            session_a.commit()
        session_a.close()
        assert_refused_at_commit(refused.value, a, b)
        assert outbox(scope_engine) == []
        b.release()
    finally:
        other.dispose()


# ------------------------------------------- issue 9 (4): ON DELETE CASCADE


def test_a_stale_holders_delete_of_a_parent_b_never_wrote_is_refused_and_bs_child_survives(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed_token = seed(
        fencer,
        make_session,
        Parent(id=1, name="p", children=[Child(id=1, value="initial")]),
    )
    a = fencer.acquire("parent:1", 5)
    session_a = a.bind(make_session())
    session_a.delete(session_a.get(Parent, 1))  # children not loaded: the database cascades
    b = grant_to_another_holder(fencer, a)
    write_as(b, make_session, lambda s: setattr(s.get(Child, 1), "value", "B"))
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()  # the parent's fence (the seed's) passes the row fence
    session_a.close()
    assert_refused_at_commit(refused.value, a, b)
    assert fetch(scope_engine, "SELECT id, fence FROM parents") == [(1, seed_token)]
    assert fetch(scope_engine, "SELECT id, value, fence FROM children") == [(1, "B", b.token)]
    b.release()


# ------------------------------------ issue 9 (5): rows B has not reached yet


def test_rows_the_newer_holder_has_not_reached_are_not_left_half_written_by_the_stale_one(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed_token = seed(
        fencer, make_session, Job(id=1, result="initial"), Job(id=2, result="initial")
    )
    a = fencer.acquire("batch", 5)
    session_a = a.bind(make_session())
    b = grant_to_another_holder(fencer, a)  # B is granted but has written nothing yet

    def a_writes_both(session: Session) -> None:
        session.get(Job, 1).result = "A"
        session.get(Job, 2).result = "A"

    a_writes_both(session_a)
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert_refused_at_commit(refused.value, a, b)
    write_as(b, make_session, lambda s: setattr(s.get(Job, 1), "result", "B"))  # B: row 1 only
    assert job_rows(scope_engine) == {1: ("B", b.token), 2: ("initial", seed_token)}
    b.release()


# ----------------------------------------- issue 9 (6): a fence in parameters


@pytest.mark.parametrize("given", FENCES_A_CALLER_MIGHT_SEND)
def test_a_fence_in_bulk_update_mappings_is_never_written(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    given: int,
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.bulk_update_mappings(Job, [{"id": 1, "result": "bulk", "fence": given}])
        session.commit()
    assert job_rows(scope_engine) == {1: ("bulk", lease.token)}


@pytest.mark.parametrize("given", FENCES_A_CALLER_MIGHT_SEND)
def test_a_fence_in_an_orm_bulk_update_by_primary_key_is_never_written(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    given: int,
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"), Job(id=2, result="initial"))
    with fencer.acquire("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.execute(
            update(Job),
            [
                {"id": 1, "fence": given, "result": "orm bulk"},
                {"id": 2, "fence": given, "result": "orm bulk"},
            ],
        )
        session.commit()
    assert job_rows(scope_engine) == {1: ("orm bulk", lease.token), 2: ("orm bulk", lease.token)}


@pytest.mark.parametrize("given", FENCES_A_CALLER_MIGHT_SEND)
def test_a_fence_in_core_update_parameters_is_never_written(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    given: int,
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    stmt = jobs.update().where(jobs.c.id == bindparam("job_id"))
    with (
        fencer.acquire("job:1", 5) as lease,
        scope_engine.connect() as conn,
        sa_fence.fence_connection(conn, lease),
    ):
        conn.execute(stmt, {"job_id": 1, "result": "core", "fence": given})
        conn.commit()
    assert job_rows(scope_engine) == {1: ("core", lease.token)}


@pytest.mark.parametrize("statement", [jobs.update().values(result="late"), jobs.delete()])
def test_a_core_write_after_the_lease_is_released_inside_fence_connection_is_refused(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
    statement: Any,
) -> None:
    """The token is still the register's newest, so neither the row fence nor the COMMIT
    would refuse: the lease's own check does, before the statement is sent."""
    seed_token = seed(fencer, make_session, Job(id=1, result="initial"))
    lease = fencer.acquire("job:1", 5)
    with scope_engine.connect() as conn, sa_fence.fence_connection(conn, lease):
        lease.release()
        statements.clear()
        with pytest.raises(sa_fence.LeaseLostError, match="released"):
            conn.execute(statement.where(jobs.c.id == 1))
        conn.rollback()
    assert not [s for s in statements if s.lstrip().startswith(("UPDATE jobs", "DELETE FROM"))]
    assert job_rows(scope_engine) == {1: ("initial", seed_token)}


@pytest.mark.parametrize("given", FENCES_A_CALLER_MIGHT_SEND)
def test_a_fence_in_insert_parameters_is_never_written(
    fencer: sa_fence.Fencer, scope_engine: sa.Engine, given: int
) -> None:
    with (
        fencer.acquire("job:1", 5) as lease,
        scope_engine.connect() as conn,
        sa_fence.fence_connection(conn, lease),
    ):
        conn.execute(jobs.insert(), {"id": 1, "result": "one", "fence": given})
        conn.execute(
            jobs.insert(),
            [
                {"id": 2, "result": "many", "fence": given},
                {"id": 3, "result": "many", "fence": given},
            ],
        )
        conn.commit()
    assert job_rows(scope_engine) == {
        1: ("one", lease.token),
        2: ("many", lease.token),
        3: ("many", lease.token),
    }


@pytest.mark.parametrize(
    "rows", [[{"id": 1, "result": "a"}, {"id": 2, "result": "b"}], [(1, "a"), (2, "b", "x")]]
)
def test_a_multi_row_insert_writes_the_lease_token_as_every_rows_fence(
    fencer: sa_fence.Fencer, scope_engine: sa.Engine, rows: list[Any]
) -> None:
    """``INSERT ... VALUES (...), (...)`` from dicts or from tuples in column order."""
    with (
        fencer.acquire("job:1", 5) as lease,
        scope_engine.connect() as conn,
        sa_fence.fence_connection(conn, lease),
    ):
        conn.execute(jobs.insert().values(rows))
        conn.commit()
    assert job_rows(scope_engine) == {1: ("a", lease.token), 2: ("b", lease.token)}


#: Core statements that set the fence themselves, in every form values() takes.
SETS_THE_FENCE = {
    "core-update": jobs.update().where(jobs.c.id == 1).values(result="x", fence=2**63 - 1),
    "core-insert": jobs.insert().values(id=2, result="x", fence=0),
    "core-insert-rows": jobs.insert().values([{"id": 2, "fence": 0}, {"id": 3}]),
    "core-insert-tuples": jobs.insert().values([(2, "x", "k", 0), (3, "y", "k", 2**63 - 1)]),
    "core-update-ordered": jobs.update()
    .where(jobs.c.id == 1)
    .ordered_values((jobs.c.result, "x"), (jobs.c.fence, 0)),
}


@pytest.mark.parametrize("kind", [*SETS_THE_FENCE, "orm-update"])
def test_a_statement_that_sets_the_fence_in_values_is_refused_and_nothing_is_written(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
    kind: str,
) -> None:
    seed_token = seed(fencer, make_session, Job(id=1, result="initial"))
    statements.clear()
    with fencer.acquire("job:1", 5) as lease:
        if kind == "orm-update":
            with make_session() as session:
                lease.bind(session)
                stmt: Any = update(Job).where(Job.id == 1).values(result="x", fence=0)
                with pytest.raises(sa_fence.FencingConfigError, match=r"sets jobs\.fence itself"):
                    session.execute(stmt)
                session.rollback()
        else:
            stmt = SETS_THE_FENCE[kind]
            with scope_engine.connect() as conn, sa_fence.fence_connection(conn, lease):
                with pytest.raises(sa_fence.FencingConfigError, match=r"sets jobs\.fence itself"):
                    conn.execute(stmt)
                conn.rollback()
    assert not [s for s in statements if s.lstrip().startswith(("UPDATE jobs", "INSERT INTO jobs"))]
    assert job_rows(scope_engine) == {1: ("initial", seed_token)}


# -------------------------------- issue 9 (7): sessions sharing a Connection


def test_two_fenced_sessions_on_one_connection_are_refused_before_the_second_writes(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    with (
        fencer.acquire("job:1", 5) as first,
        fencer.acquire("job:2", 5) as second,
        scope_engine.connect() as conn,
    ):
        outer = conn.begin()
        s1 = sa_fence.install(Session(bind=conn, join_transaction_mode="create_savepoint"))
        first.bind(s1)
        s1.get(Job, 1).result = "first"
        s1.flush()
        s2 = sa_fence.install(Session(bind=conn, join_transaction_mode="create_savepoint"))
        second.bind(s2)
        s2.add(Job(id=2, result="second"))
        statements.clear()
        with pytest.raises(sa_fence.FencingConfigError, match="share one Connection"):
            s2.flush()
        assert not [s for s in statements if s.lstrip().startswith("INSERT")]
        s2.close()
        s1.close()
        outer.rollback()
    assert job_rows(scope_engine)[1][0] == "initial"
    assert 2 not in job_rows(scope_engine)


def test_a_session_joined_to_an_outer_transaction_with_a_stale_lease_refuses_the_outer_commit(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """Lease scope outlives the session: the outer transaction's COMMIT checks it."""
    seed_token = seed(fencer, make_session, Job(id=1, result="initial"))
    a = fencer.acquire("job:1", 5)
    with scope_engine.connect() as conn:
        conn.begin()  # the outer transaction
        with sa_fence.install(
            Session(bind=conn, join_transaction_mode="create_savepoint")
        ) as session:
            a.bind(session)
            session.get(Job, 1).result = "A"
            session.add(Outbox(id=1, message="A"))
            session.commit()  # releases the savepoint; the outer transaction stays open
        b = grant_to_another_holder(fencer, a)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            conn.commit()
        assert_refused_at_commit(refused.value, a, b)
    assert job_rows(scope_engine) == {1: ("initial", seed_token)}
    assert outbox(scope_engine) == []
    b.release()


# ------------------------------------------- issue 9 (8): the token sequence


def test_a_sequence_altered_to_cache_20_after_the_first_check_refuses_the_next_acquire(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The fitness check runs at every grant, not only before the first one.

    (A Fencer naming a second sequence in the same database is refused:
    tests/lease/test_config.py::test_a_fencer_naming_another_sequence_than_its_registers_is_refused.)
    """
    with fresh_database("cache") as engine:
        metadata = sa.MetaData()
        sa_fence.fence_schema(metadata)
        metadata.create_all(engine)
        fencer = sa_fence.Fencer(redis_client, engine, key_prefix=key_prefix)
        try:
            first = fencer.acquire("job:1", 5)  # checks the sequence: fit
            first.release()
            with engine.begin() as conn:
                conn.execute(sa.text("ALTER SEQUENCE sa_fence_token_seq CACHE 20"))
            with pytest.raises(sa_fence.FencingConfigError, match="CACHE 20") as refused:
                fencer.acquire("job:1", 5)
            assert "CACHE 1" in str(refused.value)  # says how to fix it
            assert list(redis_client.scan_iter(match=key_prefix + "*")) == []
            assert register_token(engine, "job:1") == first.token  # nothing drawn
        finally:
            fencer.close()


# ----------------------------------------------------- false refusals fixed


def test_merge_of_a_detached_object_by_the_current_holder_commits(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    with make_session() as reader:
        detached = reader.get(Job, 1)  # carries the seed's fence
    with fencer.acquire("job:1", 5) as lease:
        write_as(lease, make_session, lambda s: setattr(s.get(Job, 1), "result", "first"))
        detached.result = "merged"  # its fence is now older than the row's
        with make_session() as session:
            lease.bind(session)
            merged = session.merge(detached)
            session.commit()
            assert merged.fence == lease.token
    assert job_rows(scope_engine) == {1: ("merged", lease.token)}


def test_legacy_rows_whose_fence_is_null_are_writable_and_get_the_token(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    with scope_engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO legacy (id, value, fence) VALUES (1, 'old', NULL), "
                "(2, 'old', NULL), (3, 'old', NULL)"
            )
        )
    with fencer.acquire("legacy", 5) as lease:
        with make_session() as session:
            lease.bind(session)
            session.get(Legacy, 1).value = "orm"
            session.delete(session.get(Legacy, 3))
            session.commit()
        with scope_engine.connect() as conn, sa_fence.fence_connection(conn, lease):
            conn.execute(
                legacy.update().where(legacy.c.id == bindparam("row_id")),
                {"row_id": 2, "value": "core"},
            )
            conn.commit()
    assert fetch(scope_engine, "SELECT id, value, fence FROM legacy ORDER BY id") == [
        (1, "orm", lease.token),
        (2, "core", lease.token),
    ]


def test_a_core_update_with_ordered_values_works_and_is_fenced(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"), Job(id=2, result="initial"))
    stmt = (
        update(jobs)
        .where(jobs.c.id == bindparam("job_id"))
        .ordered_values((jobs.c.result, "ordered"))
    )
    with (
        fencer.acquire("job:1", 5) as lease,
        scope_engine.connect() as conn,
        sa_fence.fence_connection(conn, lease),
    ):
        conn.execute(stmt, {"job_id": 1})
        conn.commit()
    assert job_rows(scope_engine)[1] == ("ordered", lease.token)
    a = fencer.acquire("job:2", 5)
    b = grant_to_another_holder(fencer, a)
    write_as(b, make_session, lambda s: setattr(s.get(Job, 2), "result", "B"))
    with scope_engine.connect() as conn, sa_fence.fence_connection(conn, a):
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            conn.execute(stmt, {"job_id": 2})
        conn.rollback()
    assert refused.value.table == "jobs"
    assert refused.value.primary_keys == ((2,),)
    assert job_rows(scope_engine)[2] == ("B", b.token)
    b.release()


def test_fence_connection_on_an_autocommit_connection_is_refused_before_anything_is_sent(
    fencer: sa_fence.Fencer, scope_engine: sa.Engine
) -> None:
    sent: list[str] = []
    with fencer.acquire("job:1", 5) as lease, scope_engine.connect() as plain:
        conn = plain.execution_options(isolation_level="AUTOCOMMIT")

        @sa.event.listens_for(conn, "before_cursor_execute")
        def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            sent.append(statement)

        with (
            pytest.raises(sa_fence.FencingConfigError, match="AUTOCOMMIT"),
            sa_fence.fence_connection(conn, lease),
        ):
            conn.execute(jobs.insert().values(id=1, result="autocommitted"))
    assert sent == []
    assert job_rows(scope_engine) == {}


def test_a_core_executemany_update_by_custom_bind_names_names_the_stale_row(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed_token = seed(fencer, make_session, *(Job(id=i, result="initial") for i in (1, 2, 3)))
    a = fencer.acquire("batch", 5)
    b = grant_to_another_holder(fencer, a)
    write_as(b, make_session, lambda s: setattr(s.get(Job, 2), "result", "B"))
    stmt = (
        update(jobs).where(jobs.c.id == bindparam("job_id")).values(result=bindparam("new_result"))
    )
    with scope_engine.connect() as conn, sa_fence.fence_connection(conn, a):
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            conn.execute(stmt, [{"job_id": i, "new_result": "A"} for i in (1, 2, 3)])
        conn.rollback()
    assert refused.value.statement == "UPDATE"
    assert refused.value.table == "jobs"
    assert refused.value.token == a.token
    assert refused.value.primary_keys == ((2,),)
    assert refused.value.current_fences == (b.token,)
    assert job_rows(scope_engine) == {
        1: ("initial", seed_token),
        2: ("B", b.token),
        3: ("initial", seed_token),
    }
    b.release()


#: A fenced table with a composite key (never created: the refusals below send nothing).
_cells = sa.Table(
    "cells",
    sa.MetaData(),
    sa.Column("sheet", sa.String, primary_key=True),
    sa.Column("pos", sa.Integer, primary_key=True),
    sa.Column("result", sa.String),
    sa_fence.fence_column(),
)

#: Executemany UPDATEs whose WHERE clause does not pin every primary key column to a bind.
NOT_PINNED = {
    "another column": (
        jobs,
        jobs.c.result == bindparam("old"),
        [{"old": "a", "new": "x"}, {"old": "b", "new": "y"}],
    ),
    "keys ORed": (
        jobs,
        sa.or_(jobs.c.id == bindparam("a"), jobs.c.id == bindparam("b")),
        [{"a": 1, "b": 2, "new": "x"}, {"a": 1, "b": 2, "new": "y"}],
    ),
    "part of a composite key": (
        _cells,
        _cells.c.sheet == bindparam("s"),
        [{"s": "a", "new": "x"}, {"s": "b", "new": "y"}],
    ),
}


@pytest.mark.parametrize(("table", "where", "params"), NOT_PINNED.values(), ids=NOT_PINNED.keys())
def test_an_executemany_update_whose_where_does_not_pin_the_primary_key_is_refused(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    scope_engine: sa.Engine,
    statements: list[str],
    table: sa.Table,
    where: Any,
    params: list[dict[str, Any]],
) -> None:
    """Its row count could not tell a stale row skipped from a row not matched."""
    seed_token = seed(fencer, make_session, Job(id=1, result="a"), Job(id=2, result="b"))
    stmt = update(table).where(where).values(result=bindparam("new"))
    statements.clear()
    with (
        fencer.acquire("batch", 5) as lease,
        scope_engine.connect() as conn,
        sa_fence.fence_connection(conn, lease),
    ):
        with pytest.raises(sa_fence.FencingConfigError, match="does not pin every primary key"):
            conn.execute(stmt, params)
        conn.rollback()
    assert not [s for s in statements if s.lstrip().startswith("UPDATE")]
    assert job_rows(scope_engine) == {1: ("a", seed_token), 2: ("b", seed_token)}


def test_a_single_update_whose_keys_are_ored_is_a_criteria_update(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """Not targeted by key: both rows are written, no row count compared (an AND of the keys
    alone pins them)."""
    seed(fencer, make_session, Job(id=1, result="a"), Job(id=2, result="b"))
    where = sa.or_(jobs.c.id == bindparam("a"), jobs.c.id == bindparam("b"))
    with (
        fencer.acquire("batch", 5) as lease,
        scope_engine.connect() as conn,
        sa_fence.fence_connection(conn, lease),
    ):
        conn.execute(update(jobs).where(where).values(result="x"), {"a": 1, "b": 2})
        conn.commit()
    assert job_rows(scope_engine) == {1: ("x", lease.token), 2: ("x", lease.token)}


# ---------------------------------------- the current holder is never refused


def test_many_sessions_of_the_current_lease_commit_concurrently(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    workers = 8
    barrier = threading.Barrier(workers)
    errors: list[BaseException] = []

    def work(i: int, lease: sa_fence.Lease) -> None:
        try:
            with make_session() as session:
                lease.bind(session)
                session.add(Job(id=i, result=f"worker {i}"))
                session.add(Outbox(id=i, message=f"worker {i}"))
                session.flush()
                barrier.wait(timeout=10)  # every transaction has written and is open
                session.commit()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    with fencer.acquire("batch", 5) as lease:
        threads = [threading.Thread(target=work, args=(i, lease)) for i in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert errors == []
        assert register_token(scope_engine, "batch") == lease.token  # it is the newest grant
    assert job_rows(scope_engine) == {i: (f"worker {i}", lease.token) for i in range(workers)}
    assert len(outbox(scope_engine)) == workers


def test_a_stale_leases_read_only_transactions_are_refused_at_commit_too(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    """Every transaction in lease scope is armed at BEGIN, so PostgreSQL checks
    its COMMIT even when it only read (or only sent a NOTIFY): a stale holder
    learns at its next commit, and its writes never commit."""
    seed(fencer, make_session, Job(id=1, result="initial"))
    a = fencer.acquire("job:1", 5)
    session_a = a.bind(make_session())
    b = grant_to_another_holder(fencer, a)
    assert session_a.get(Job, 1).result == "initial"
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    assert_refused_at_commit(refused.value, a, b)
    session_a.rollback()
    with scope_engine.connect() as conn, sa_fence.fence_connection(conn, a):
        assert conn.execute(select(jobs.c.id)).scalars().all() == [1]
        with pytest.raises(sa_fence.StaleTokenError):
            conn.commit()
    session_a.add(Outbox(id=1, message="A"))
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert_refused_at_commit(refused.value, a, b)
    assert outbox(scope_engine) == []
    b.release()


def test_a_stale_holders_commits_from_before_the_newer_grant_stand(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], scope_engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    a = fencer.acquire("job:1", 5)
    session_a = a.bind(make_session())
    session_a.get(Job, 1).result = "A early"
    session_a.add(Outbox(id=1, message="A early"))
    session_a.commit()
    b = grant_to_another_holder(fencer, a)
    session_a.get(Job, 1).result = "A late"
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert_refused_at_commit(refused.value, a, b)
    assert job_rows(scope_engine) == {1: ("A early", a.token)}
    assert outbox(scope_engine) == ["A early"]
    b.release()


# -------------------------------------------------- stateful property test

N_NAMES = 2
MAX_HOLDERS = 6
HOLDER_TTL = 5.0  # short; a holder goes stale through sa_fence.testing.expire, not sleep
OPS = ["job", "special", "tags", "recreate", "insert", "cascade", "child", "outbox"]

MACHINE_SETTINGS = settings(
    max_examples=15,
    stateful_step_count=20,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
# The guard-removed pair only has to find one violation: no shrinking.
BROKEN_MACHINE_SETTINGS = settings(
    MACHINE_SETTINGS, phases=[Phase.generate], report_multiple_bugs=False
)


def base_of(n: int) -> int:
    """Each lease name owns its own rows (ids base+1 .. base+3): only its holders write them."""
    return 100 * (n + 1)


def reset_rows(engine: sa.Engine) -> None:
    """Empty the tables and give each name its rows (written without a lease: fence 0)."""
    with engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
        for table in ("job_tags", "children", "parents", "special_jobs", "jobs", "tags", "outbox"):
            conn.execute(sa.text(f"DELETE FROM {table}"))
        for n in range(N_NAMES):
            base = base_of(n)
            conn.execute(
                sa.text(
                    "INSERT INTO jobs (id, result, kind) VALUES "
                    "(:b + 1, 'seed', 'job'), (:b + 2, 'seed', 'job'), (:b + 3, 'seed', 'special')"
                ),
                {"b": base},
            )
            conn.execute(
                sa.text("INSERT INTO special_jobs (id, detail) VALUES (:b + 3, 'seed')"),
                {"b": base},
            )
            conn.execute(
                sa.text("INSERT INTO tags (id, label) VALUES (:b + 1, 't1'), (:b + 2, 't2')"),
                {"b": base},
            )
            conn.execute(
                sa.text("INSERT INTO job_tags (job_id, tag_id) VALUES (:b + 1, :b + 1)"),
                {"b": base},
            )
            conn.execute(
                sa.text("INSERT INTO parents (id, name) VALUES (:b + 1, 'p')"), {"b": base}
            )
            conn.execute(
                sa.text("INSERT INTO children (id, parent_id, value) VALUES (:b + 1, :b + 1, 'c')"),
                {"b": base},
            )


def snapshot(engine: sa.Engine) -> dict[str, frozenset[tuple[Any, ...]]]:
    """Every committed row of every table the machine writes."""
    with engine.connect() as conn:
        return {
            table: frozenset(tuple(r) for r in conn.execute(sa.text(f"SELECT * FROM {table}")))
            for table in TABLES
        }


@dataclass
class Holder:
    n: int  # which name
    lease: sa_fence.Lease
    session: Session


def lease_scope_machine(
    engine: sa.Engine,
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    redis_client: redis.Redis,
) -> Callable[[], RuleBasedStateMachine]:
    """The machine, on these fixtures (hypothesis builds one per example)."""

    class LeaseScopeMachine(RuleBasedStateMachine):
        """Holders are granted names, go stale, write all sorts of things and commit.

        Model: per name, the newest granted token.  Invariant: a transaction
        that commits anything belongs to its name's newest grant, and the
        newest grant's holder is never refused.
        """

        def __init__(self) -> None:
            super().__init__()
            run = uuid.uuid4().hex[:8]  # register rows and Redis keys of this example only
            self.names = [f"scope:{run}:{n}" for n in range(N_NAMES)]
            self.newest: dict[str, int] = {}
            self.live: dict[str, Holder] = {}
            self.holders: list[Holder] = []
            self.next_id = 10_000
            self.steps = 0
            reset_rows(engine)

        def fresh_id(self) -> int:
            self.next_id += 1
            return self.next_id

        def pick(self, drawn: int) -> Holder:
            return self.holders[drawn % len(self.holders)]

        def is_current(self, holder: Holder) -> bool:
            return self.newest[self.names[holder.n]] == holder.lease.token

        @precondition(lambda self: len(self.holders) < MAX_HOLDERS)
        @rule(n=st.integers(0, N_NAMES - 1))
        def grant(self, n: int) -> None:
            """A new holder for name n; its live holder (if any) stalls past its TTL."""
            name = self.names[n]
            live = self.live.get(name)
            if live is not None:
                expire(live.lease)  # False only if its short TTL already ran out: the same
            lease = fencer.acquire(name, HOLDER_TTL)
            assert lease.token > self.newest.get(name, 0)
            self.newest[name] = lease.token
            holder = Holder(n, lease, lease.bind(make_session()))
            self.holders.append(holder)
            self.live[name] = holder

        @precondition(lambda self: self.holders)
        @rule(drawn=st.integers(0, MAX_HOLDERS - 1), op=st.sampled_from(OPS))
        def write(self, drawn: int, op: str) -> None:
            """Change something in memory (autoflush is off: sent at the commit)."""
            holder = self.pick(drawn)
            self.steps += 1
            try:
                self.apply(holder.session, base_of(holder.n), op, f"{op}-{self.steps}")
            except ObjectDeletedError:
                # a stale holder's identity map still has a row someone deleted
                assert not self.is_current(holder)

        def apply(self, s: Session, base: int, op: str, value: str) -> None:
            if op == "job":
                job = s.get(Job, base + 1)
                if job is not None:
                    job.result = value
            elif op == "special":
                special = s.get(SpecialJob, base + 3)
                if special is not None:
                    special.detail = value  # the subclass table only
            elif op == "tags":
                job, tag = s.get(Job, base + 1), s.get(Tag, base + 2)
                if job is not None and tag is not None:
                    if tag in job.tags:
                        job.tags.remove(tag)
                    else:
                        job.tags.append(tag)
            elif op == "recreate":
                job = s.get(Job, base + 2)
                if job is None:
                    s.add(Job(id=base + 2, result=value))
                else:
                    s.delete(job)
            elif op == "insert":
                s.add(Job(id=self.fresh_id(), result=value))
            elif op == "cascade":
                parent = s.get(Parent, base + 1)
                if parent is None:
                    s.add(Parent(id=base + 1, name=value, children=[Child(id=base + 1)]))
                else:
                    s.delete(parent)  # the database deletes its child
            elif op == "child":
                child = s.get(Child, base + 1)
                if child is not None:
                    child.value = value
            else:
                s.add(Outbox(id=self.fresh_id(), message=value))

        @precondition(lambda self: self.holders)
        @rule(drawn=st.integers(0, MAX_HOLDERS - 1), new_session=st.booleans())
        def commit(self, drawn: int, new_session: bool) -> None:
            holder = self.pick(drawn)
            name = self.names[holder.n]
            current = self.is_current(holder)
            before = snapshot(engine)
            error: Exception | None = None
            try:
                holder.session.commit()
            except (sa_fence.StaleTokenError, sa.exc.IntegrityError) as exc:
                error = exc
                holder.session.rollback()
            if error is None:
                assert current or snapshot(engine) == before, (
                    f"a stale holder's transaction committed after a newer grant of {name}: "
                    f"token {holder.lease.token}, newest {self.newest[name]}"
                )
            else:
                assert not current, f"the current holder of {name} was refused: {error!r}"
                assert snapshot(engine) == before, "a refused transaction left rows behind"
                if isinstance(error, sa_fence.StaleTokenError) and error.statement == "COMMIT":
                    assert error.lease_name == name
                    assert error.token == holder.lease.token
                    assert error.newest_token == self.newest[name]
            if new_session:  # many sessions of one lease
                holder.session.close()
                holder.session = holder.lease.bind(make_session())

        @invariant()
        def the_register_and_redis_hold_the_newest_grant(self) -> None:
            for name, token in self.newest.items():
                assert register_token(engine, name) == token
                # Redis holds the newest holder's lease (or nothing, once its TTL ran out)
                assert stored_token(redis_client, fencer.key(name)) in (token, None)

        def teardown(self) -> None:
            for holder in self.holders:
                holder.session.close()
                holder.lease.release()

    return LeaseScopeMachine


@pytest.fixture
def machine(
    scope_engine: sa.Engine,
    fencer: sa_fence.Fencer,
    redis_client: redis.Redis,
) -> Callable[[], RuleBasedStateMachine]:
    make_session = sa_fence.install(sessionmaker(scope_engine, autoflush=False))
    return lease_scope_machine(scope_engine, fencer, make_session, redis_client)


@pytest.mark.slow
def test_in_any_interleaving_no_stale_holder_commits_and_the_current_holder_is_never_refused(
    machine: Callable[[], RuleBasedStateMachine],
) -> None:
    run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


@pytest.mark.slow
def test_without_lease_scope_and_the_row_fence_the_state_machine_finds_a_stale_commit(
    machine: Callable[[], RuleBasedStateMachine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair of the test above: remove both guards and the violation is found."""
    monkeypatch.setattr(arming, "enter_scope", lambda conn, lease: None)
    monkeypatch.setattr(_rewrite, "fence_predicate", lambda col, token: sa.true())
    monkeypatch.setattr(_rewrite, "_rewritten", weakref.WeakKeyDictionary())  # built anew
    with pytest.raises(AssertionError, match="a stale holder's transaction committed"):
        run_state_machine_as_test(machine, settings=BROKEN_MACHINE_SETTINGS)


def test_fence_connection_scopes_a_later_transaction_that_only_sends_driver_sql(
    fencer: sa_fence.Fencer, scope_engine: sa.Engine
) -> None:
    """exec_driver_sql passes no statement hook: the transaction is scoped when it begins."""
    a = fencer.acquire("job:1", 5)
    with scope_engine.connect() as conn, sa_fence.fence_connection(conn, a):
        conn.commit()  # the block's first transaction ends; the next begins on its own
        conn.exec_driver_sql("INSERT INTO outbox (id, message) VALUES (1, 'A, raw driver SQL')")
        b = grant_to_another_holder(fencer, a)
        with pytest.raises(sa_fence.StaleTokenError, match="commit refused"):
            conn.commit()
    with scope_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 0
    b.release()
