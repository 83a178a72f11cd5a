"""Helpers for your own tests: reproduce "my lease expired mid-work" without sleeping.

A lease that expires in production is just a Redis key that is gone (or
belongs to someone else) while the worker still holds a ``Lease`` object.
:func:`expire` makes that happen on demand, so a test can run the lost-lease
scenario (docs/index.md, "The problem") deterministically against real servers::

    from sa_fence.testing import expire

    def test_a_worker_that_lost_its_lease_cannot_overwrite_the_new_holder(fencer, Session):
        a = fencer.acquire("job:1", ttl=30)
        session_a = a.bind(Session())
        session_a.get(Job, 1).result = "A"
        expire(a)                                   # A "pauses" past its TTL
        with fencer.acquire("job:1", ttl=30) as b, Session() as session_b:
            b.bind(session_b)
            session_b.get(Job, 1).result = "B"
            session_b.commit()
        with pytest.raises(sa_fence.StaleTokenError):
            session_a.commit()
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, overload

from .lease import lifecycle as steps

if TYPE_CHECKING:
    from collections.abc import Callable

    from .lease.aio import AsyncLease
    from .lease.sync import Lease

__all__ = ["expire", "pause", "resume"]


@overload
def expire(lease: Lease) -> bool: ...
@overload
def expire(lease: AsyncLease) -> Coroutine[Any, Any, bool]: ...
def expire(lease: Lease | AsyncLease) -> bool | Coroutine[Any, Any, bool]:
    """End ``lease`` in Redis now, as if its TTL had run out.

    Owner-checked like :meth:`Lease.release` (it never removes another owner's lease), but the
    ``Lease`` object is left believing it still holds the lease, exactly like a paused worker.
    Returns True when the key was removed, False when it had already expired or been taken over;
    for an :class:`~sa_fence.AsyncLease`, a coroutine of that (``await expire(lease)``).
    """
    if not (hasattr(lease, "fencer") and hasattr(lease, "key")):
        raise TypeError(f"expire() takes a lease (fencer.acquire()), got {lease!r}")
    reply = steps.expire(lease)
    if inspect.isawaitable(reply):  # an AsyncLease: its redis.asyncio client's reply

        async def expired() -> bool:
            return bool(int(await reply))

        return expired()
    return bool(int(reply))


def pause(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGSTOP a child process and return once the kernel reports it stopped.

    For two-process tests: a real worker frozen mid-work, like a long GC
    pause, while the test lets its lease run out.  POSIX only; ``proc`` must
    be this process's child.  Raises ``ChildProcessError`` if it exited
    instead, ``TimeoutError`` if it was not stopped within ``timeout``.
    """
    _signal(proc, signal.SIGSTOP, timeout)
    _wait_status(proc, os.WUNTRACED, os.WIFSTOPPED, "stopped", timeout)


def resume(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGCONT a child process stopped by :func:`pause`; return once it runs again."""
    _signal(proc, signal.SIGCONT, timeout)
    _wait_status(proc, os.WCONTINUED, os.WIFCONTINUED, "continued", timeout)


def _signal(proc: subprocess.Popen[Any], sig: int, timeout: float) -> None:
    """Send ``sig`` to ``proc`` once the arguments are checked: a bad one sends nothing."""
    if not isinstance(getattr(proc, "pid", None), int):
        raise TypeError(f"takes a subprocess.Popen child process, got {proc!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    os.kill(proc.pid, sig)


def _wait_status(
    proc: subprocess.Popen[Any],
    option: int,
    check: Callable[[int], bool],
    what: str,
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, option | os.WNOHANG)
        if pid == 0:
            time.sleep(0.002)
        elif check(status):
            return
        else:  # it terminated instead: record what Popen can no longer reap
            proc.returncode = os.waitstatus_to_exitcode(status)
            raise ChildProcessError(
                f"process {proc.pid} exited with {proc.returncode} instead of being {what}"
            )
    raise TimeoutError(f"process {proc.pid} was not {what} within {timeout:g} s")
