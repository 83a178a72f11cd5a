"""Side effects that leave only from current holders: fenced jobs on procrastinate.

An e-mail or a payment call cannot be taken back, so it is enqueued in the fenced
transaction as a `procrastinate <https://procrastinate.readthedocs.io/>`_ job: the
job row commits with the transaction lease scope checks (a stale holder's never
does), and carries an idempotency key, ``<lease name>:<token>:<transaction>:<n>``::

    with fencer.lease("order:7", ttl=30) as lease, Session() as session:
        lease.bind(session)
        session.get(Order, 7).state = "paid"
        sa_fence.side_effect(session, send_receipt, order_id=7)
        session.commit()   # the order and its job commit together, or neither does

``side_effect_async`` does the same for an ``AsyncSession``; docs/side-effects.md
has the whole guide.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sqlalchemy.orm import Session, scoped_session

from . import _flush, _scope
from ._decorators import await_steps, run_steps
from .errors import FencingConfigError, UnfencedWriteError

if TYPE_CHECKING:
    from procrastinate.tasks import Task
    from procrastinate.types import JSONValue
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncSession

    from ._flush import Lease

__all__ = ["KEY_ARGUMENT", "SideEffect", "side_effect", "side_effect_async"]

#: The task argument each job's idempotency key is passed in.
KEY_ARGUMENT = "idempotency_key"

#: The transaction's id (assigned if it has none yet): 64 bits with the epoch, never
#: repeated in a database's life; 13's pg_current_xact_id() is the same value.
_XID_SQL = "SELECT txid_current()::text"

_INFO_KEY = "sa_fence.side_effects"

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


def _check_task(task: object, kwargs: dict[str, Any]) -> None:
    try:
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


def _require_scope(conn: Connection, lease: Lease) -> None:
    """The job row must be inside the transaction's lease scope, or it commits unchecked."""
    if not _scope.in_scope(conn, lease):
        raise FencingConfigError(
            f"this session's transaction is not lease-scoped for {lease.name!r} (it writes to "
            "another database than the lease register's), so its COMMIT would not check the lease "
            "and a stale holder's job would be delivered. Enqueue side effects in the database "
            "that holds the lease register and the queue's tables. Nothing was enqueued."
        )


def _enqueue(
    session: Any, sync: Session, task: Task[Any, Any, Any], task_kwargs: dict[str, Any]
) -> Generator[Any, Any, SideEffect]:
    """Steps of both front ends (see sa_fence._decorators): ``session`` is ``sync`` or the
    AsyncSession around it, whose awaitables side_effect_async awaits."""
    is_async = session is not sync
    lease = _flush.bound_lease(sync)
    if lease is None:
        raise UnfencedWriteError(
            "this session has no lease bound, so a side effect enqueued in it would not be "
            "fenced: a stale worker's e-mail or HTTP call would go out. Acquire a lease and "
            "call lease.bind(session) first (sa_fence.unfenced() does not apply to side "
            "effects). Nothing was enqueued."
        )
    lease.check(for_write=True)  # released, or known lost: LeaseLostError, nothing sent
    conn = yield session.connection()  # begins the transaction: lease scope is entered here
    _require_scope(conn.sync_connection if is_async else conn, lease)
    raw = (yield conn.get_raw_connection()) if is_async else conn.connection
    driver: Any = raw.driver_connection
    transaction = sync.get_transaction()
    # (the transaction, its id, the effects numbered so far): the id is read by the first effect
    numbered, xid, count = sync.info.get(_INFO_KEY, (None, "", 0))
    if numbered is not transaction:
        cursor = driver.cursor()
        try:
            yield cursor.execute(_XID_SQL)
            xid, count = str((yield cursor.fetchone())[0]), 0
        finally:
            yield cursor.close()
    count += 1
    sync.info[_INFO_KEY] = (transaction, xid, count)
    key = f"{quote(lease.name, safe=_SAFE)}:{lease.token}:{xid}:{count}"
    try:
        deferrer = task.configure(connection=driver)
        defer = deferrer.defer_async if is_async else deferrer.defer
        job_id = yield defer(**task_kwargs, **{KEY_ARGUMENT: key})
    except Exception as exc:  # procrastinate's tables, functions or types missing here?
        from psycopg.errors import UndefinedFunction, UndefinedObject, UndefinedTable

        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, UndefinedTable | UndefinedFunction | UndefinedObject) and (
                "procrastinate" in str(cause)
            ):
                raise FencingConfigError(
                    "procrastinate's queue tables are not in this session's database "
                    f"({str(cause).strip()}). Create them where the fenced rows and the lease "
                    "register are: `procrastinate --app=<your app> schema --apply`, or the "
                    "Alembic revision in the side-effects docs. Roll the session back: "
                    "nothing of this transaction can commit."
                ) from exc
            cause = cause.__cause__ or cause.__context__
        raise
    return SideEffect(job_id=job_id, idempotency_key=key)


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
    cannot take the key; in each case nothing is enqueued.  For an ``AsyncSession`` use
    :func:`side_effect_async`.
    """
    _check_task(task, task_kwargs)
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
    _check_task(task, task_kwargs)
    sync: object = getattr(session, "sync_session", None)
    if not isinstance(sync, Session):
        raise TypeError(
            "side_effect_async() takes a sqlalchemy AsyncSession bound to a lease (use "
            f"side_effect() for a Session); got {type(session).__name__}"
        )
    return await await_steps(_enqueue(session, sync, task, task_kwargs))
