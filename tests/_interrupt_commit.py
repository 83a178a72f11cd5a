"""Interrupt a bound session's COMMIT with a signal handler's exception, in a process of its own.

Run by tests/scope/test_scope_trigger.py (``python -m tests._interrupt_commit URL
PREFIX EXCEPTION [--no-invalidate] [--arm]``; ``--arm``: interrupt instead the arm of a
lease bound mid-transaction, a statement of its own that waits on a lock of the scope
table another connection holds): the exception a handler raises mid-COMMIT
leaves CPython 3.11's AST recursion counter off for the rest of the process
(``SystemError: AST constructor recursion depth mismatch`` at pytest's exit),
so the interruption happens here, not in the test run.  Prints ``next session
ok`` or ``next session failed: ...`` for the one-connection pool's next session.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.scope import arming
from tests.conftest import REDIS_URL
from tests.models_scope import Outbox


class SoftTimeLimit(Exception):
    """What Celery's soft time limit raises from its signal handler."""


def slow_commit(dbapi_conn: Any) -> None:
    """A COMMIT that waits in the server first."""
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute("SELECT pg_sleep(3); COMMIT")
    finally:
        cursor.close()


#: A backend of this database waiting where the interruption must find it: on the scope table's
#: lock (the arm) or in the COMMIT's pg_sleep.  (A fixed timer fired before the statement was
#: sent on a loaded machine, and the pair then found nothing to break.)
_WAITING_SQL = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND pid <> pg_backend_pid() AND (wait_event_type = 'Lock' OR wait_event = 'PgSleep')"
)


def interrupt_once_waiting(url: str) -> threading.Thread:
    """Send this process SIGALRM once a backend waits as above (at most 20 s)."""

    def watch() -> None:
        with sa.create_engine(url, poolclass=sa.pool.NullPool).connect() as conn:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if conn.execute(sa.text(_WAITING_SQL)).scalar_one():
                    os.kill(os.getpid(), signal.SIGALRM)
                    return
                conn.rollback()
                time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


def main(url: str, prefix: str, kind: str, invalidate: bool, arm: bool) -> None:
    raise_: type[BaseException] = (
        KeyboardInterrupt if kind == "KeyboardInterrupt" else SoftTimeLimit
    )
    engine = sa.create_engine(url, pool_size=1, max_overflow=0, pool_timeout=5)
    fencer = sa_fence.Fencer(redis.Redis.from_url(REDIS_URL), engine, key_prefix=prefix)
    if not invalidate:
        arming._invalidate = lambda conn: None  # type: ignore[assignment]
    send_commit = arming._send_commit
    arming._send_commit = slow_commit  # type: ignore[assignment]  # the test seam

    def handler(signum: int, frame: Any) -> None:
        raise raise_("interrupted")

    signal.signal(signal.SIGALRM, handler)
    lease = fencer.acquire(f"job:{uuid.uuid4().hex[:8]}", 30)
    session = sa_fence.install(sessionmaker(engine))()
    blocker = sa.create_engine(url, poolclass=sa.pool.NullPool).connect() if arm else None
    interrupted: Callable[[], object]
    if blocker is not None:
        session.execute(sa.text("SELECT 1"))  # begun: the bind's arm is a statement of its own
        blocker.execute(sa.text("LOCK TABLE sa_fence_scope IN ACCESS EXCLUSIVE MODE"))
        interrupted = functools.partial(lease.bind, session)
    else:
        lease.bind(session)
        session.add(Outbox(id=1, message="interrupted"))
        session.flush()
        interrupted = session.commit
    watcher = interrupt_once_waiting(url)
    try:
        interrupted()
        print("not interrupted")
        return
    except raise_:
        pass
    finally:
        watcher.join()
        if blocker is not None:
            blocker.close()
    arming._send_commit = send_commit  # type: ignore[assignment]
    with contextlib.suppress(Exception):
        session.close()
    lease.release()
    try:
        with Session(engine) as other:
            assert other.execute(sa.text("SELECT 1")).scalar_one() == 1
            other.commit()
        print("next session ok")
    except Exception as exc:
        print(f"next session failed: {type(exc).__name__}")


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        sys.argv[3],
        invalidate="--no-invalidate" not in sys.argv,
        arm="--arm" in sys.argv,
    )
