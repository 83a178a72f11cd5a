"""The fenced flush on real PostgreSQL and Redis: what commits and what is refused."""

from __future__ import annotations

import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import delete, update
from sqlalchemy.orm import Session, aliased, sessionmaker

import sa_fence
from sa_fence.orm import flush as _flush
from sa_fence.orm import rewrite as _rewrite
from sa_fence.orm import session_state
from sa_fence.orm import statements as _statements
from sa_fence.scope import arming
from sa_fence.testing import expire
from tests._sql import recorded_statements, seed
from tests.models import Audit, Cell, Job


@pytest.fixture
def statements(engine: sa.Engine) -> Iterator[list[str]]:
    """Every SQL statement the engine sends while the test runs."""
    with recorded_statements(engine) as sent:
        yield sent


def row(engine: sa.Engine, job_id: int) -> tuple[Any, ...] | None:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT result, fence FROM jobs WHERE id = :id"), {"id": job_id}
        ).one_or_none()
    return None if found is None else tuple(found)


def run_seed_scenario(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> tuple[sa_fence.Lease, sa_fence.Lease, Session]:
    """The lost-lease scenario up to A's late write: A (TTL 200 ms) stalls 500 ms, B writes."""
    seed(fencer, make_session, Job(id=1, result="initial"))
    a = fencer.acquire("job:1", 0.2)
    session_a = a.bind(make_session())
    session_a.get(Job, 1).result = "A"  # A has done its work but not flushed yet
    time.sleep(0.5)  # A stalls past its TTL (2.5x)
    with fencer.acquire("job:1", 5) as b, make_session() as session_b:
        b.bind(session_b)
        session_b.get(Job, 1).result = "B"
        session_b.commit()
    return a, b, session_a


def test_a_stale_holders_write_after_its_lease_expired_is_refused_and_the_row_keeps_bs_value(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    a, b, session_a = run_seed_scenario(fencer, make_session)
    assert b.token > a.token
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert refused.value.table == "jobs"
    assert refused.value.primary_keys == ((1,),)
    assert refused.value.token == a.token
    assert refused.value.current_fences == (b.token,)
    assert "jobs" in str(refused.value)
    assert f"token {a.token}" in str(refused.value)
    assert row(engine, 1) == ("B", b.token)


def test_without_the_token_comparison_the_stale_write_overwrites_b(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above: remove the guard and the lost-lease double write comes back."""
    monkeypatch.setattr(_rewrite, "fence_predicate", lambda col, token: sa.true())
    monkeypatch.setattr(_rewrite, "_rewritten", weakref.WeakKeyDictionary())  # built anew
    monkeypatch.setattr(arming, "enter_scope", lambda conn, lease: None)  # no lease scope
    a, _b, session_a = run_seed_scenario(fencer, make_session)
    session_a.commit()  # goes through: this is the bug sa-fence exists to stop
    session_a.close()
    assert row(engine, 1) == ("A", a.token)


def test_the_stale_token_error_is_a_stale_data_error(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    _a, _b, session_a = run_seed_scenario(fencer, make_session)
    with pytest.raises(sa.orm.exc.StaleDataError):
        session_a.commit()
    session_a.close()


def test_the_same_holder_writes_one_row_many_times(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    with fencer.acquire("job:1", 5) as lease:
        for n in range(3):
            with make_session() as session:
                lease.bind(session)
                session.get(Job, 1).result = f"pass {n}"
                session.flush()
                session.get(Job, 1).status = "running"
                session.commit()
        assert row(engine, 1) == ("pass 2", lease.token)


def test_an_insert_writes_the_lease_token_as_the_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with fencer.acquire("job:7", 5) as lease, make_session() as session:
        lease.bind(session)
        job = Job(id=7, result="new")
        session.add(job)
        session.commit()
        assert job.fence == lease.token
    assert row(engine, 7) == ("new", lease.token)


def test_a_stale_delete_is_refused_and_the_row_survives(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    a = fencer.acquire("job:1", 0.2)
    session_a = a.bind(make_session())
    session_a.delete(session_a.get(Job, 1))
    time.sleep(0.5)
    with fencer.acquire("job:1", 5) as b, make_session() as session_b:
        b.bind(session_b)
        session_b.get(Job, 1).result = "B"
        session_b.commit()
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert refused.value.statement == "DELETE"
    assert refused.value.primary_keys == ((1,),)
    assert row(engine, 1) == ("B", b.token)


def test_a_session_without_a_lease_may_not_write_fenced_rows_and_sends_nothing(
    make_session: sessionmaker[Session], engine: sa.Engine, statements: list[str]
) -> None:
    with make_session() as session:
        session.add(Job(id=3, result="sneaky"))
        with pytest.raises(sa_fence.UnfencedWriteError, match=r"lease\.bind\(session\)"):
            session.flush()
    assert not [s for s in statements if s.lstrip().upper().startswith(("INSERT", "UPDATE"))]
    assert row(engine, 3) is None


def test_a_session_without_a_lease_still_writes_unfenced_tables(
    make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with make_session() as session:
        session.add(Audit(id=1, message="free"))
        session.commit()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM audit")).scalar_one() == 1


def test_the_unfenced_opt_out_lets_an_admin_script_write_without_a_lease(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with make_session() as session, sa_fence.unfenced(session):
        session.add(Job(id=4, result="admin"))
        session.commit()
    assert row(engine, 4) == ("admin", 0)
    token = seed(fencer, make_session, Job(id=5, result="fenced"))
    with make_session() as session, sa_fence.unfenced(session):
        session.get(Job, 5).result = "fixed by admin"
        session.commit()
    assert row(engine, 5) == ("fixed by admin", token)  # fence left as it was
    with make_session() as session:  # the opt-out ends with the block
        session.get(Job, 5).result = "again"
        with pytest.raises(sa_fence.UnfencedWriteError):
            session.commit()


def test_unbind_detaches_the_lease_and_later_fenced_writes_need_a_new_one(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    statements: list[str],
) -> None:
    with make_session() as session:
        with fencer.acquire("job:1", 5) as first:
            first.bind(session)
            session.add(Job(id=1, result="first"))
            session.commit()
            sa_fence.unbind(session)
        session.get_one(Job, 1).result = "unbound"
        statements.clear()
        with pytest.raises(sa_fence.UnfencedWriteError, match="no lease bound"):
            session.flush()
        assert not [s for s in statements if s.lstrip().upper().startswith("UPDATE")]
        session.rollback()
        session.add(Audit(id=1, message="an unfenced table is free, as without a lease"))
        session.commit()
        with fencer.acquire("job:1", 5) as second:
            second.bind(session)
            session.get_one(Job, 1).result = "second"
            session.commit()
    assert row(engine, 1) == ("second", second.token)


def test_unbind_inside_a_transaction_leaves_it_held_to_the_lease_at_commit(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """What the transaction wrote under the lease stays in its scope: unbinding is no way out
    of the COMMIT check once a newer holder has the name."""
    a = fencer.acquire("job:1", 5)
    with make_session() as session:
        a.bind(session)
        session.add(Job(id=1, result="A"))
        session.flush()
        sa_fence.unbind(session)
        assert expire(a)
        with fencer.acquire("job:1", 5), pytest.raises(sa_fence.StaleTokenError):
            session.commit()
    assert row(engine, 1) is None


def test_unbind_of_a_session_never_bound_or_not_installed_changes_nothing(
    make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with make_session() as fenced, Session(engine) as plain:
        sa_fence.unbind(fenced)
        sa_fence.unbind(plain)
        plain.add(Job(id=2, result="plain"))
        plain.commit()
        fenced.add(Job(id=3, result="fenced"))
        with pytest.raises(sa_fence.UnfencedWriteError):
            fenced.commit()
    assert row(engine, 2) == ("plain", 0)


def test_a_released_lease_no_longer_fences_its_session(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    lease = fencer.acquire("job:9", 5)
    with make_session() as session:
        lease.bind(session)
        lease.release()
        session.add(Job(id=9))
        with pytest.raises(sa_fence.LeaseLostError, match="released"):
            session.commit()
    assert row(engine, 9) is None


def test_binding_a_session_without_the_hook_is_refused(
    fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    with (
        fencer.acquire("job:1", 5) as lease,
        Session(engine) as plain,
        pytest.raises(sa_fence.FencingConfigError, match=r"sa_fence\.install"),
    ):
        lease.bind(plain)


def test_a_session_at_a_dead_sessionmakers_address_installs_and_uninstalls(
    engine: sa.Engine,
) -> None:
    """SQLAlchemy keys listeners on ``(id(target), event, id(fn))`` and keeps the
    keys of a sessionmaker's (class-level) listeners after it is collected.  A
    session later allocated at that address met those keys, and
    ``uninstall(session)`` failed inside SQLAlchemy (seen in CI, by chance).
    Here the address reuse is staged in the registry, deterministically."""
    from sqlalchemy.event import registry

    dead = sa_fence.install(sessionmaker(engine))
    session = Session(engine)
    staged = []
    # a copy in one C call: a collected listener's weakref callback may change the
    # registry while a Python-level iteration runs
    for (target_id, name, fn_id), collections in registry._key_to_collection.copy().items():
        if target_id == id(dead):  # what a session at that address would meet
            key = (id(session), name, fn_id)
            registry._key_to_collection[key] = dict(collections)
            staged.append(key)
    assert len(staged) == len(_flush._EVENTS)
    try:
        sa_fence.install(session)
        assert _flush.is_installed(session)
        sa_fence.uninstall(session)
        assert not _flush.is_installed(session)
        assert not [fn for name, _ in _flush._EVENTS for fn in getattr(session.dispatch, name)]
    finally:
        for key in staged:
            registry._key_to_collection.pop(key, None)
        sa_fence.uninstall(dead)


def test_install_works_on_a_session_a_session_class_and_uninstall_removes_it(
    fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    one = sa_fence.install(Session(engine))
    assert sa_fence.install(one) is one  # idempotent

    class MySession(Session):
        pass

    sa_fence.install(MySession)
    with fencer.acquire("job:1", 5) as lease:
        for session in (one, MySession(engine)):
            lease.bind(session)
            session.close()
    sa_fence.uninstall(MySession)
    sa_fence.uninstall(one)
    with fencer.acquire("job:1", 5) as lease, pytest.raises(sa_fence.FencingConfigError):
        lease.bind(MySession(engine))
    with pytest.raises(TypeError, match="Session subclass"):
        sa_fence.install(engine)  # type: ignore[arg-type]


def test_one_stale_row_in_a_batched_flush_refuses_the_whole_flush_and_names_that_row(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    statements: list[str],
) -> None:
    seed(fencer, make_session, *[Job(id=i, result="initial") for i in range(50)])
    a = fencer.acquire("batch", 5)
    session_a = a.bind(make_session())
    jobs = session_a.scalars(sa.select(Job).order_by(Job.id)).all()
    with fencer.acquire("row-17", 5) as b, make_session() as session_b:  # a newer holder
        b.bind(session_b)
        session_b.get(Job, 17).result = "B"
        session_b.commit()
    for job in jobs:
        job.result = "A"
    del statements[:]
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert refused.value.primary_keys == ((17,),)
    assert refused.value.current_fences == (b.token,)
    updates = [s for s in statements if s.startswith("UPDATE jobs")]
    assert len(updates) == 1, "the 50 rows go out as one executemany, not one per row"
    assert "<= CAST(set_config('sa_fence.token'" in updates[0]
    with engine.connect() as conn:
        results = conn.execute(sa.text("SELECT DISTINCT result FROM jobs")).scalars().all()
    assert sorted(results) == ["B", "initial"]


def test_a_stale_write_to_a_composite_key_row_names_the_whole_key(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    seed(fencer, make_session, Cell(sheet="s1", pos=2, value="v0"))
    a = fencer.acquire("sheet:s1", 5)
    session_a = a.bind(make_session())
    session_a.get(Cell, ("s1", 2)).value = "A"
    with fencer.acquire("sheet:s1:newer", 5) as b, make_session() as session_b:
        b.bind(session_b)
        session_b.get(Cell, ("s1", 2)).value = "B"
        session_b.commit()
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session_a.commit()
    session_a.close()
    assert refused.value.table == "cells"
    assert refused.value.primary_keys == (("s1", 2),)
    assert "('s1', 2)" in str(refused.value)


# ----------------------------------------------------------- ORM bulk statements


def newer_rows(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> tuple[sa_fence.Lease, int]:
    """Rows 1-4 written by a stale lease A; then rows 3 and 4 by a newer holder B."""
    seed(fencer, make_session, *[Job(id=i, result="initial") for i in range(1, 5)])
    a = fencer.acquire("bulk-a", 5)
    with fencer.acquire("bulk-b", 5) as b, make_session() as session_b:
        b.bind(session_b)
        for i in (3, 4):
            session_b.get(Job, i).result = "B"
        session_b.commit()
    return a, b.token


def test_an_orm_bulk_update_skips_rows_with_a_newer_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    a, b_token = newer_rows(fencer, make_session)
    with make_session() as session:
        a.bind(session)
        in_session = session.get(Job, 3)
        result = session.execute(update(Job).values(result="A"))
        assert result.rowcount == 2  # type: ignore[attr-defined]
        assert in_session.result == "B", "the skipped row is not synchronised as written"
        session.commit()
    assert [row(engine, i) for i in range(1, 5)] == [
        ("A", a.token),
        ("A", a.token),
        ("B", b_token),
        ("B", b_token),
    ]


def test_an_orm_bulk_delete_skips_rows_with_a_newer_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    a, b_token = newer_rows(fencer, make_session)
    with make_session() as session:
        a.bind(session)
        session.execute(delete(Job).where(Job.id > 0))
        session.commit()
    assert [row(engine, i) for i in range(1, 5)] == [None, None, ("B", b_token), ("B", b_token)]


def test_an_orm_bulk_update_by_primary_key_refuses_a_newer_row(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    a, b_token = newer_rows(fencer, make_session)
    with make_session() as session:
        a.bind(session)
        with pytest.raises(sa_fence.StaleTokenError) as refused:
            session.execute(update(Job), [{"id": 2, "result": "A"}, {"id": 3, "result": "A"}])
        session.rollback()
    assert refused.value.primary_keys == ((3,),)
    assert row(engine, 2) == ("initial", row(engine, 1)[1])  # type: ignore[index]
    assert row(engine, 3) == ("B", b_token)


def test_after_a_refused_bulk_update_the_next_orm_write_is_refused_before_it_is_sent(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    statements: list[str],
) -> None:
    """A refusal outside a flush leaves SQLAlchemy's transaction open: the session is
    poisoned, so a later ORM statement is refused at once, not only its commit."""
    a, _ = newer_rows(fencer, make_session)
    with make_session() as session:
        a.bind(session)
        with pytest.raises(sa_fence.StaleTokenError):
            session.execute(update(Job), [{"id": 3, "result": "A"}])
        statements.clear()
        with pytest.raises(sa_fence.FenceError, match=r"write refused.*session\.rollback") as later:
            session.execute(update(Job), [{"id": 1, "result": "A"}])
        assert isinstance(later.value.__cause__, sa_fence.StaleTokenError)
        assert not [s for s in statements if s.lstrip().upper().startswith("UPDATE")]
        session.rollback()
    assert row(engine, 1) == ("initial", row(engine, 2)[1])  # type: ignore[index]


def test_a_core_update_sent_through_a_bound_session_is_fenced_too(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    a, b_token = newer_rows(fencer, make_session)
    jobs = Job.__table__
    with make_session() as session:
        a.bind(session)
        session.connection().execute(jobs.update().values(result="core"))
        session.commit()
    assert row(engine, 1) == ("core", a.token)
    assert row(engine, 3) == ("B", b_token)


def test_an_orm_bulk_update_without_a_lease_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seed_token = seed(fencer, make_session, Job(id=1, result="initial"))
    with make_session() as session:
        with pytest.raises(sa_fence.UnfencedWriteError):
            session.execute(update(Job).values(result="x"))
        assert not session.in_transaction()  # refused before the session began one
        session.rollback()  # (nothing to roll back: the refusal left no mark to clear)
        with sa_fence.unfenced(session):  # so the session is usable, as after any refusal
            session.execute(update(Job).values(result="admin"))
        session.commit()
    assert row(engine, 1) == ("admin", seed_token)


# ---------------------------------- statements the hook cannot rewrite: aliases, DML CTEs

_jobs = Job.__table__
_j = _jobs.alias("j")
_k = _j.alias("k")
_aliased_job = aliased(Job)

#: DML of fenced table jobs through an alias: refused (the hook fences the table's own DML).
THROUGH_AN_ALIAS: dict[str, Callable[[Session], Any]] = {
    "core update": lambda s: s.execute(update(_j).where(_j.c.id == 1).values(result="A")),
    "orm update": lambda s: s.execute(
        update(_aliased_job).where(_aliased_job.id == 1).values(result="A")
    ),
    "core delete": lambda s: s.execute(delete(_j).where(_j.c.id == 1)),
    "alias of an alias": lambda s: s.execute(update(_k).where(_k.c.id == 1).values(result="A")),
}


def _update_cte(nesting: bool = False) -> Any:
    return (
        update(_jobs)
        .where(_jobs.c.id == 1)
        .values(result="A")
        .returning(_jobs.c.id)
        .cte("u", nesting=nesting)
    )


#: A DML of jobs in a CTE, wherever the CTE is: refused (the hook rewrites the statement it
#: is given, not one nested in it).
IN_A_CTE: dict[str, Callable[[Session], Any]] = {
    "orm update in a select": lambda s: s.execute(
        sa.select(update(Job).where(Job.id == 1).values(result="A").returning(Job.id).cte("u"))
    ),
    "core update in a select": lambda s: s.execute(sa.select(_update_cte().c.id)),
    "delete in a select": lambda s: s.execute(
        sa.select(delete(_jobs).where(_jobs.c.id == 1).returning(_jobs.c.id).cte("d").c.id)
    ),
    "cte in a subquery": lambda s: s.execute(
        sa.select(sa.select(_update_cte().c.id).subquery().c.id)
    ),
    # (PostgreSQL refuses a DML CTE below the top level; sa-fence, before it is sent)
    "nesting cte in a subquery": lambda s: s.execute(
        sa.select(sa.select(_update_cte(nesting=True).c.id).subquery().c.id)
    ),
    "add_cte of another table's update": lambda s: s.execute(
        update(Audit).values(message="x").add_cte(_update_cte())
    ),
    "insert from a select of it": lambda s: s.execute(
        sa.insert(Audit).from_select(
            ["id", "message"], sa.select(_update_cte().c.id, sa.literal("x"))
        )
    ),
    "add_cte of an update of jobs": lambda s: s.execute(
        update(Job).where(Job.id == 2).values(result="other").add_cte(_update_cte())
    ),
    "insert in a select": lambda s: s.execute(
        sa.select(sa.insert(_jobs).values(id=9, result="A").returning(_jobs.c.id).cte("i"))
    ),
}

UNREWRITABLE = {**THROUGH_AN_ALIAS, **IN_A_CTE}
#: Those PostgreSQL runs without a lease, refused only by the new checks (a plain update(Job)
#: with a CTE is refused as such already).
RUN_UNFENCED = {
    k: v
    for k, v in UNREWRITABLE.items()
    if k not in {"nesting cte in a subquery", "add_cte of an update of jobs"}
}
_WRITES_JOBS = re.compile(r"\b(UPDATE|DELETE FROM|INSERT INTO) jobs\b")


def b_wrote_job_1(fencer: sa_fence.Fencer, make_session: sessionmaker[Session]) -> tuple[Any, int]:
    """Jobs 1 and 2, then job 1 written by a newer holder B: lease A is the stale one."""
    seed(fencer, make_session, Job(id=1, result="initial"), Job(id=2, result="initial"))
    a = fencer.acquire("unrewritable-a", 5)
    with fencer.acquire("unrewritable-b", 5) as b, make_session() as session_b:
        b.bind(session_b)
        session_b.get(Job, 1).result = "B"
        session_b.commit()
    return a, b.token


@pytest.mark.parametrize("write", UNREWRITABLE.values(), ids=UNREWRITABLE.keys())
def test_dml_of_a_fenced_table_through_an_alias_or_in_a_cte_is_refused_before_it_is_sent(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    statements: list[str],
    write: Callable[[Session], Any],
) -> None:
    a, b_token = b_wrote_job_1(fencer, make_session)
    statements.clear()
    with make_session() as session:
        a.bind(session)
        with pytest.raises(sa_fence.FencingConfigError) as refused:
            write(session)
        with pytest.raises(sa_fence.FenceError, match=r"session\.rollback"):
            session.commit()  # the session may not commit any part of it
    a.release()
    message = str(refused.value)
    assert "fenced table 'jobs'" in message
    assert "Nothing was sent" in message
    if write in THROUGH_AN_ALIAS.values():
        assert "through an alias" in message
        assert "rather than" in message
    else:
        assert "inside a CTE" in message
        assert "as a statement of its own" in message
    assert not [s for s in statements if _WRITES_JOBS.search(s)]
    assert row(engine, 1) == ("B", b_token)
    assert row(engine, 9) is None


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "no-lease"])
@pytest.mark.parametrize("what", ["alias", "cte"])
async def test_an_async_session_refuses_dml_through_an_alias_or_in_a_cte_too(
    afencer: sa_fence.AsyncFencer,
    make_async_session: Any,
    engine: sa.Engine,
    bound: bool,
    what: str,
) -> None:
    """The same hooks, reached through the greenlet: nothing is sent."""
    stmt = (
        update(_aliased_job).where(_aliased_job.id == 1).values(result="A")
        if what == "alias"
        else sa.select(update(Job).where(Job.id == 1).values(result="A").returning(Job.id).cte())
    )
    refusal = sa_fence.FencingConfigError if bound else sa_fence.UnfencedWriteError
    async with afencer.acquire("job:1", 5) as lease, make_async_session() as session:
        if bound:
            lease.bind(session)
        with pytest.raises(refusal, match="fenced table 'jobs'"):
            await session.execute(stmt)
        await session.rollback()
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(Job)).scalar_one() == 0


@pytest.mark.parametrize("write", RUN_UNFENCED.values(), ids=RUN_UNFENCED.keys())
def test_without_a_lease_dml_through_an_alias_or_in_a_cte_is_refused_and_unfenced_lets_it(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    statements: list[str],
    write: Callable[[Session], Any],
) -> None:
    """As a plain update(Job) without a lease: UnfencedWriteError, and an unfenced() block
    (which compares nothing) sends it as written."""
    seed_token = seed(fencer, make_session, Job(id=1, result="initial"), Job(id=2, result="x"))
    statements.clear()
    with make_session() as session:
        with pytest.raises(sa_fence.UnfencedWriteError, match="of fenced table 'jobs'"):
            write(session)
        session.rollback()
        assert statements == []
        with sa_fence.unfenced(session):
            write(session)
        session.commit()
    assert row(engine, 1) != ("initial", seed_token) or row(engine, 9) is not None


def _unfenced_alias_and_ctes(session: Session) -> list[Any]:
    """DML of unfenced table audit through an alias and in CTEs, as SQLAlchemy runs it."""
    audit = Audit.__table__
    a, other = audit.alias("a"), aliased(Audit)
    added = sa.insert(audit).values(id=1, message="in a cte").returning(audit.c.id).cte("i")
    done = [session.scalars(sa.select(added.c.id)).all()]
    session.execute(update(a).where(a.c.id == 1).values(message="through an alias"))
    changed = update(other).values(message="in a subquery").returning(other.id).cte("u")
    done.append(session.scalars(sa.select(sa.select(changed.c.id).subquery().c.id)).all())
    copied = sa.insert(audit).values(id=2, message="copied").returning(audit.c.id).cte("c")
    session.execute(update(Audit).where(Audit.id == 99).values(message="none").add_cte(copied))
    gone = delete(audit).returning(audit.c.message).cte("d")
    done.append(sorted(session.scalars(sa.select(gone.c.message))))
    return done


def test_dml_of_an_unfenced_table_through_an_alias_or_in_a_cte_works_as_without_sa_fence(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with Session(engine) as plain:  # the outcome without sa-fence
        expected = _unfenced_alias_and_ctes(plain)
        plain.rollback()
    assert expected == [[1], [1], ["copied", "in a subquery"]]
    with make_session() as session:  # no lease bound
        assert _unfenced_alias_and_ctes(session) == expected
        session.commit()
    with fencer.acquire("audit", 5) as lease, lease.bind(make_session()) as session:
        assert _unfenced_alias_and_ctes(session) == expected
        session.commit()


def test_without_the_refusal_a_stale_dml_through_an_alias_or_in_a_cte_overwrites_b(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the refusals above: neither is fenced, so A writes over B's row."""
    monkeypatch.setattr(_statements, "_refuse_unfenceable", lambda *args: None)
    a, b_token = b_wrote_job_1(fencer, make_session)
    for write in (THROUGH_AN_ALIAS["orm update"], IN_A_CTE["core update in a select"]):
        with make_session() as session:
            a.bind(session)
            write(session)
            session.commit()
        assert row(engine, 1) == ("A", b_token)  # B's row, overwritten; its fence left behind
        with engine.begin() as conn:
            conn.execute(_jobs.update().where(_jobs.c.id == 1).values(result="B"))
    a.release()


# ------------------------------------------------------------------ savepoints


def stale_write_in_a_savepoint(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> Session:
    """Inside one transaction: an unfenced audit row, then a stale fenced write in a savepoint."""
    seed(fencer, make_session, Job(id=1, result="initial"))
    a = fencer.acquire("job:1", 5)
    session = a.bind(make_session())
    session.get(Job, 1)
    with fencer.acquire("job:1:newer", 5) as b, make_session() as session_b:
        b.bind(session_b)
        session_b.get(Job, 1).result = "B"
        session_b.commit()
    session.add(Audit(id=1, message="A started"))
    session.flush()

    def stale_write() -> None:
        with session.begin_nested():
            session.get(Job, 1).result = "A"
            session.flush()

    with pytest.raises(sa_fence.StaleTokenError):
        stale_write()
    return session


def test_a_fencing_error_inside_a_savepoint_poisons_the_session_until_rollback(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    with stale_write_in_a_savepoint(fencer, make_session) as session:
        with pytest.raises(sa_fence.FenceError, match="rollback"):
            session.commit()
        session.add(Audit(id=2, message="more"))
        with pytest.raises(sa_fence.FenceError, match="rollback"):
            session.flush()
        session.rollback()
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM audit")).scalar_one() == 0
        # after the rollback the session is usable again
        session.add(Audit(id=3, message="after rollback"))
        session.commit()


def test_without_poisoning_the_outer_transaction_would_commit_the_other_writes(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the test above: SQLAlchemy alone lets the savepoint's siblings commit."""
    monkeypatch.setattr(session_state.SessionState, "fail", lambda self, error: error)
    with stale_write_in_a_savepoint(fencer, make_session) as session:
        session.commit()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM audit")).scalar_one() == 1


# ------------------------------------------------------------- isolation levels


def wait_until_blocked(engine: sa.Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            ).scalar_one()
            conn.rollback()
            if waiting:
                return
            time.sleep(0.01)
    raise AssertionError("the stale UPDATE never blocked on the row lock")


def test_under_read_committed_a_blocked_stale_update_rechecks_the_fence_and_is_refused(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    a = fencer.acquire("job:1", 5)
    session_a = a.bind(make_session())
    session_a.get(Job, 1).result = "A"
    b = fencer.acquire("job:1:newer", 5)
    session_b = b.bind(make_session())
    session_b.get(Job, 1).result = "B"
    session_b.flush()  # B holds the row lock, not committed yet
    outcome: list[BaseException | None] = []

    def write_a() -> None:
        try:
            session_a.commit()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=write_a)
    thread.start()
    wait_until_blocked(engine)
    session_b.commit()
    thread.join(10)
    assert isinstance(outcome[0], sa_fence.StaleTokenError)
    session_a.close()
    session_b.close()
    assert row(engine, 1) == ("B", b.token)


def test_under_repeatable_read_a_stale_update_gets_a_serialization_failure(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    """Documented: PostgreSQL raises 40001 instead of matching zero rows; nothing is written."""
    seed(fencer, make_session, Job(id=1, result="initial"))
    rr = sa_fence.install(sessionmaker(engine.execution_options(isolation_level="REPEATABLE READ")))
    a = fencer.acquire("job:1", 5)
    session_a = a.bind(rr())
    session_a.get(Job, 1).result = "A"  # snapshot taken here
    with fencer.acquire("job:1:newer", 5) as b, make_session() as session_b:
        b.bind(session_b)
        session_b.get(Job, 1).result = "B"
        session_b.commit()
    with pytest.raises(sa.exc.OperationalError) as failed:
        session_a.commit()
    session_a.close()
    assert failed.value.orig is not None
    assert failed.value.orig.sqlstate == "40001"  # type: ignore[attr-defined]
    assert row(engine, 1) == ("B", b.token)


# ------------------------------------------------------- where the hook lives


def test_install_leaves_the_users_engine_and_the_bind_untouched(engine: sa.Engine) -> None:
    maker = sessionmaker(engine)
    sa_fence.install(maker)
    assert maker.kw["bind"] is engine  # no private view is bound (issue 18)
    with maker() as session:
        session.connection()
    assert not sa.event.contains(engine, "before_execute", _statements._before_execute)
    sa_fence.uninstall(maker)
    assert maker.kw["bind"] is engine


def test_a_session_class_install_fences_through_per_connection_listeners(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    class FencedSession(Session):
        pass

    sa_fence.install(FencedSession)
    try:
        _a, b, session_a = run_seed_scenario(
            fencer,
            lambda: FencedSession(engine),  # type: ignore[arg-type]
        )
        with pytest.raises(sa_fence.StaleTokenError):
            session_a.commit()
        session_a.close()
        assert row(engine, 1) == ("B", b.token)
    finally:
        sa_fence.uninstall(FencedSession)


def test_a_plain_session_on_the_same_engine_is_not_fenced(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    with Session(engine) as plain:
        plain.get(Job, 1).result = "plain"
        plain.commit()  # no hook: written as is (the documented limit)
    assert row(engine, 1)[0] == "plain"  # type: ignore[index]


def test_core_dml_on_a_sessions_connection_without_a_lease_is_refused_before_it_is_sent(
    fencer: sa_fence.Fencer,
    make_session: sessionmaker[Session],
    engine: sa.Engine,
    statements: list[str],
) -> None:
    seed(fencer, make_session, Job(id=1, result="initial"))
    jobs = Job.__table__
    with make_session() as session:
        conn = session.connection()
        del statements[:]
        with pytest.raises(sa_fence.UnfencedWriteError):
            conn.execute(jobs.update().values(result="core"))
        session.rollback()
    assert not [s for s in statements if s.startswith("UPDATE")]
    assert row(engine, 1)[0] == "initial"  # type: ignore[index]


def test_a_class_mapped_after_the_orm_index_was_built_is_in_it() -> None:
    """The index is rebuilt after a class is mapped, not looked over on every flush."""
    from sqlalchemy.orm import DeclarativeBase, relationship

    from sa_fence.orm import model

    model.orm_index()  # built before the classes below exist

    class LateBase(DeclarativeBase):
        pass

    links = sa.Table(
        "late_links",
        LateBase.metadata,
        sa.Column("owner_id", sa.ForeignKey("late_owners.id"), primary_key=True),
        sa.Column("tag_id", sa.ForeignKey("late_tags.id"), primary_key=True),
    )

    others = sa.Table(  # its relationship declared on the unfenced side only
        "late_other_links",
        LateBase.metadata,
        sa.Column("owner_id", sa.ForeignKey("late_owners.id"), primary_key=True),
        sa.Column("tag_id", sa.ForeignKey("late_tags.id"), primary_key=True),
    )

    class LateTag(LateBase):
        __tablename__ = "late_tags"
        id = sa.Column(sa.Integer, primary_key=True)
        owners = relationship("LateOwner", secondary=others)

    class LateOwner(sa_fence.Fenced, LateBase):
        __tablename__ = "late_owners"
        id = sa.Column(sa.Integer, primary_key=True)
        tags = relationship(LateTag, secondary=links)

    try:
        assert {links, others} <= model.orm_index().association_tables
    finally:
        LateBase.registry.dispose()


def test_a_schema_per_tenant_through_schema_translate_map_is_fenced_in_the_tenants_schema(
    engine: sa.Engine, fencer: sa_fence.Fencer
) -> None:
    """Multi-tenant apps map the models' schema to a tenant's with schema_translate_map: the
    token-compared UPDATE goes to the tenant's table, and a stale holder is refused there."""
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA IF EXISTS tenant_a CASCADE; CREATE SCHEMA tenant_a"))
    tenant = engine.execution_options(schema_translate_map={None: "tenant_a"})
    try:
        Job.metadata.create_all(tenant, tables=[Job.__table__])
        maker = sa_fence.install(sessionmaker(tenant))
        a = fencer.acquire("job:tenant", 5)
        with maker() as session:
            a.bind(session)
            session.add(Job(id=1, result="a"))
            session.commit()
        assert expire(a)
        with fencer.acquire("job:tenant", 5) as b, maker() as session:
            b.bind(session)
            session.get_one(Job, 1).result = "b"
            session.commit()
            with maker() as stale:
                a.bind(stale)
                stale.get_one(Job, 1).result = "stale"
                with pytest.raises(sa_fence.StaleTokenError) as refused:
                    stale.commit()
        assert refused.value.table == "jobs"
        assert refused.value.current_fences == (b.token,)
        with tenant.connect() as conn:
            assert conn.execute(sa.select(Job.result, Job.fence)).all() == [("b", b.token)]
            assert conn.execute(sa.text("SELECT count(*) FROM public.jobs")).scalar() == 0
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("DROP SCHEMA tenant_a CASCADE"))
