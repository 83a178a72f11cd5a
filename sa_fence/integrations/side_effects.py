"""Side effects that leave only from current holders: fenced jobs on procrastinate.

An e-mail or a payment call cannot be taken back, so it is enqueued in the fenced
transaction as a `procrastinate <https://procrastinate.readthedocs.io/>`_ job: the
job row commits with the transaction lease scope checks (a stale holder's never
does), and carries an idempotency key, ``<lease name>:<token>:<transaction>:<n>``::

    with fencer.acquire("order:7", ttl=30) as lease, Session() as session:
        lease.bind(session)
        session.get(Order, 7).state = "paid"
        sa_fence.side_effect(session, send_receipt, order_id=7)
        session.commit()   # the order and its job commit together, or neither does

``side_effect_async`` does the same for an ``AsyncSession``; docs/side-effects.md
has the whole guide.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import weakref
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from psycopg import Error
from psycopg.errors import UndefinedFunction, UndefinedObject, UndefinedTable
from psycopg.pq import TransactionStatus
from sqlalchemy.orm import Session, scoped_session

from ..errors import FenceError, FencingConfigError, UnfencedWriteError
from ..orm import session_state
from ..scope import arming
from .decorators import await_steps, run_steps

if TYPE_CHECKING:
    from procrastinate.tasks import Task
    from procrastinate.types import JSONValue
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncSession

    from ..orm.session_state import Lease

__all__ = ["KEY_ARGUMENT", "SideEffect", "side_effect", "side_effect_async"]

#: The task argument each job's idempotency key is passed in.
KEY_ARGUMENT = "idempotency_key"

#: The transaction's id (assigned if it has none yet): 64 bits with the epoch, never
#: repeated in a database's life; 13's pg_current_xact_id() is the same value.
_XID_SQL = "SELECT txid_current()::text"

_INFO_KEY = "sa_fence.side_effects"

#: The code points UTF-8 cannot encode (not Unicode text): jsonb refuses one alone.
_SURROGATE = re.compile("[\ud800-\udfff]")

#: Around the INSERT of a job with a queueing lock (see _enqueue).
_SAVEPOINT = "sa_fence_side_effect"

#: Characters of a lease name kept as they are in a key; the rest is
#: percent-encoded, so a key is always printable ASCII (a valid header value).
_SAFE = ":/@-_.~+=,;!*()[]{}"


@dataclass(frozen=True, slots=True)
class SideEffect:
    """A side effect enqueued in the bound session's transaction (delivered if it commits)."""

    #: procrastinate's job id (the row is visible to workers once the transaction commits).
    job_id: int
    #: The key the job's task receives as ``idempotency_key``, the same on every attempt.
    idempotency_key: str


def _check_task(task: object, kwargs: dict[str, Any], *, is_async: bool) -> None:
    try:
        from procrastinate.connector import BaseAsyncConnector
        from procrastinate.tasks import Task
    except ImportError:
        raise ImportError(
            "sa_fence.side_effect() enqueues procrastinate jobs, and procrastinate is not "
            "installed: pip install 'sa-fence[side-effects]'. Nothing was enqueued."
        ) from None

    if not isinstance(task, Task):
        raise TypeError(
            "side_effect() takes a procrastinate task (a function decorated with "
            f"@app.task), got {type(task).__name__}. Nothing was enqueued."
        )
    if KEY_ARGUMENT in kwargs:
        raise ValueError(
            f"do not pass {KEY_ARGUMENT}= to side_effect(): sa-fence makes the key from the "
            "lease and the transaction and passes it to the task itself. Nothing was enqueued."
        )
    params = inspect.signature(task.func).parameters.values()
    if not any(
        p.kind is p.VAR_KEYWORD or (p.name == KEY_ARGUMENT and p.kind is not p.POSITIONAL_ONLY)
        for p in params
    ):
        raise TypeError(
            f"task {task.name!r} has no {KEY_ARGUMENT!r} parameter: add `{KEY_ARGUMENT}: str` to "
            "it and send it with the effect (an Idempotency-Key header, a Message-ID) so the "
            "receiver can deduplicate retries. Nothing was enqueued."
        )
    # (the App's, as configure() takes it): an open async PsycopgConnector is its own sync
    # connector, and procrastinate would run async cursor code on a sync connection
    connector = getattr(getattr(task.blueprint, "job_manager", None), "connector", None)
    if not is_async and isinstance(
        connector and connector.get_sync_connector(), BaseAsyncConnector
    ):
        raise TypeError(
            f"side_effect() cannot enqueue task {task.name!r}: its app's {type(connector).__name__}"
            " is async and open, so there is no sync connector to write the job on this "
            "session's sync connection. Use `await sa_fence.side_effect_async(...)` with an "
            "AsyncSession, or an app with procrastinate.SyncPsycopgConnector. Nothing was enqueued."
        )
    for name, value in kwargs.items():
        _refuse_unfit(value, f"argument {name}")


def _refuse_unfit(value: Any, where: str) -> None:
    """Refuse what JSON has but PostgreSQL's jsonb cannot hold, before anything is sent: its
    INSERT would abort the transaction (other types fail client-side, in json.dumps)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):  # (other keys become JSON strings, such as "NaN")
                _refuse_unfit(key, f"the key {key!r} of {where}")
            _refuse_unfit(item, f"{where}[{key!r}]")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _refuse_unfit(item, f"{where}[{i}]")
        return
    if isinstance(value, float) and not math.isfinite(value):
        problem = f"{value!r}: JSON numbers are finite"
    elif not isinstance(value, str):
        return
    elif "\x00" in value:
        problem = "a NUL character: jsonb cannot store \\u0000"
    elif value.isascii() or not _SURROGATE.search(value):
        return
    else:
        problem = "a surrogate code point: it is not Unicode text, and jsonb refuses a lone one"
    raise ValueError(
        f"side_effect(): {where} holds {problem}. PostgreSQL would refuse the job's INSERT "
        "and abort the transaction; convert the value first. Nothing was enqueued."
    )


def _require_scope(conn: Connection, lease: Lease) -> None:
    """The job row must be inside the transaction's lease scope, or it commits unchecked."""
    if not arming.in_scope(conn, lease):
        raise FencingConfigError(
            f"this session's transaction is not lease-scoped for {lease.name!r} (it writes to "
            "another database than the lease register's), so its COMMIT would not check the lease "
            "and a stale holder's job would be delivered. Enqueue side effects in the database "
            "that holds the lease register and the queue's tables. Nothing was enqueued."
        )


def _enqueue(
    session: Any, sync: Session, task: Task[Any, Any, Any], task_kwargs: dict[str, Any]
) -> Generator[Any, Any, SideEffect]:
    """Steps of both front ends (see sa_fence.integrations.decorators): ``session`` is
    ``sync`` or the AsyncSession around it, whose awaitables side_effect_async awaits."""
    is_async = session is not sync
    lease = session_state.bound_lease(sync)
    if lease is None:
        raise UnfencedWriteError(
            "this session has no lease bound, so a side effect enqueued in it would not be "
            "fenced: a stale worker's e-mail or HTTP call would go out. Acquire a lease and "
            "call lease.bind(session) first (sa_fence.unfenced() does not apply to side "
            "effects). Nothing was enqueued."
        )
    lease.check(for_write=True)  # released, or known lost: LeaseLostError, nothing sent
    conn = yield session.connection()  # begins the transaction: lease scope is entered here
    sync_conn: Connection = conn.sync_connection if is_async else conn
    _require_scope(sync_conn, lease)
    raw = (yield conn.get_raw_connection()) if is_async else conn.connection
    driver: Any = raw.driver_connection
    # The number counts the *database* transaction's effects, whatever sends them (a session
    # joined to an outer transaction commits only its part; sessions may share a connection):
    # kept on the DBAPI connection with the xid, read again when the Connection's root
    # transaction changes, the one sign of a new database transaction costing no round trip
    # (the same xid read goes on counting).  Numbers of rolled-back savepoints stay spent; a
    # counter in the database would cost a round trip per effect and be undone by ROLLBACK TO.
    transaction: Any = sync_conn.get_transaction()
    numbered, xid, count = raw.info.get(_INFO_KEY, (None, "", 0))
    if numbered is None or numbered() is not transaction:
        cursor = driver.cursor()
        try:
            yield cursor.execute(_XID_SQL)
            read = str((yield cursor.fetchone())[0])
        finally:
            yield cursor.close()
        xid, count = read, count if read == xid else 0
    count += 1
    raw.info[_INFO_KEY] = (weakref.ref(transaction), xid, count)
    key = f"{quote(lease.name, safe=_SAFE)}:{lease.token}:{xid}:{count}"
    deferrer = task.configure(connection=driver)
    defer = deferrer.defer_async if is_async else deferrer.defer
    # A job with a queueing lock is written in a savepoint: its AlreadyEnqueued, which callers
    # catch and go on from, would abort the transaction.  Others not: their payload is checked
    # first, what still fails is a set-up or programming error, and a savepoint costs two round
    # trips (+80-170 us on an ~800 us effect, measured) and a subtransaction (past 64 in one
    # transaction, a batch's e-mails, snapshots overflow their cache: every backend slows).
    # A failure leaving the transaction aborted poisons the session instead (_failed).
    savepoint = deferrer.job.queueing_lock is not None
    try:
        if savepoint:
            yield driver.execute(f"SAVEPOINT {_SAVEPOINT}")
        job_id = yield defer(**task_kwargs, **{KEY_ARGUMENT: key})
        if savepoint:
            yield driver.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
    except BaseException as exc:
        if savepoint and isinstance(exc, Exception):
            with contextlib.suppress(Exception):  # (if not, the transaction stays aborted)
                if driver.info.transaction_status == TransactionStatus.INERROR:
                    yield driver.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
                yield driver.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
        if (error := _failed(sync, driver, exc)) is not exc:
            raise error from exc
        raise
    return SideEffect(job_id=job_id, idempotency_key=key)


def _failed(sync: Session, driver: Any, exc: BaseException) -> BaseException:
    """What to raise for a failed enqueue.  A transaction it left aborted poisons the session:
    PostgreSQL would end its COMMIT as a ROLLBACK, and psycopg returns from that silently."""
    cause: BaseException | None = exc  # (procrastinate raises its own, from psycopg's)
    while cause is not None and not isinstance(cause, Error):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, UndefinedTable | UndefinedFunction | UndefinedObject) and (
        "procrastinate" in str(cause)
    ):  # a set-up error: nothing of this transaction commits, aborted or not
        return session_state.state_for(sync).fail(
            FencingConfigError(
                "procrastinate's queue tables are not in this session's database "
                f"({str(cause).strip()}). Create them where the fenced rows and the lease "
                "register are: `procrastinate --app=<your app> schema --apply`, or the "
                "Alembic revision in the side-effects docs. Roll the session back: "
                "nothing of this transaction can commit."
            )
        )
    if driver.info.transaction_status != TransactionStatus.INTRANS:
        what = type(exc).__name__ if cause is None else f"{type(cause).__name__}: {cause}"
        session_state.state_for(sync).fail(
            FenceError(
                f"a side effect's job could not be enqueued ({what.strip().splitlines()[0]}), "
                "and PostgreSQL aborted the transaction: it can only roll back"
            )
        )
        exc.add_note(
            "sa-fence: this aborted the session's transaction; session.commit() is refused "
            "until session.rollback()"
        )
    return exc


def side_effect(
    session: Session | scoped_session[Any], task: Task[Any, Any, Any], /, **task_kwargs: JSONValue
) -> SideEffect:
    """Enqueue ``task(**task_kwargs)`` in ``session``'s transaction, fenced by its lease.

    The job row is written on the session's own connection, inside its current transaction, so
    lease scope covers it: it commits with the session's other writes or not at all, and a stale
    holder's ``COMMIT`` is refused (:class:`~sa_fence.StaleTokenError`) with the job in it.  The
    task receives one more argument, ``idempotency_key``, unique to this effect and the same on
    every delivery attempt.

    Raises :class:`~sa_fence.UnfencedWriteError` when no lease is bound,
    :class:`~sa_fence.LeaseLostError` when the bound lease is released or known lost,
    :class:`~sa_fence.FencingConfigError` when the transaction is not lease-scoped (another
    database), ``TypeError``/``ValueError`` for a task that is not a procrastinate task or
    cannot take the key, an argument PostgreSQL's jsonb cannot hold (NaN, ``"\\x00"``...) or
    an app whose async connector is open; in each case nothing is enqueued.  A job PostgreSQL
    refuses aborts the transaction: the session then refuses to commit until rolled back (a
    task with a ``queueing_lock`` is written in a savepoint: ``AlreadyEnqueued`` leaves the
    transaction usable).  For an ``AsyncSession`` use :func:`side_effect_async`.
    """
    _check_task(task, task_kwargs, is_async=False)
    sync: Any = session() if isinstance(session, scoped_session) else session
    if isinstance(getattr(sync, "sync_session", None), Session):  # an AsyncSession
        if sync is session:
            raise TypeError(
                "side_effect() got an AsyncSession: use `await sa_fence.side_effect_async(...)`"
            )
        sync = sync.sync_session
    if not isinstance(sync, Session):
        raise TypeError(
            "side_effect() takes a sqlalchemy Session (or scoped_session) bound to a lease, "
            f"and side_effect_async() an AsyncSession; got {type(sync).__name__}"
        )
    return run_steps(_enqueue(sync, sync, task, task_kwargs))


async def side_effect_async(
    session: AsyncSession, task: Task[Any, Any, Any], /, **task_kwargs: JSONValue
) -> SideEffect:
    """:func:`side_effect` for an ``AsyncSession`` (a procrastinate ``PsycopgConnector`` app).

    The job is written with ``defer_async`` on the session's own psycopg
    ``AsyncConnection``, in its current transaction.
    """
    _check_task(task, task_kwargs, is_async=True)
    sync: object = getattr(session, "sync_session", None)
    if not isinstance(sync, Session):
        raise TypeError(
            "side_effect_async() takes a sqlalchemy AsyncSession bound to a lease (use "
            f"side_effect() for a Session); got {type(session).__name__}"
        )
    return await await_steps(_enqueue(session, sync, task, task_kwargs))
