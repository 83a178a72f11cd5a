"""The synchronous front end of :mod:`sa_fence.lease.lifecycle`: :class:`Fencer` and :class:`Lease`.

Each call is made when the lifecycle asks for it; renewed leases share one thread per fencer
(:class:`Deadlines`).  ``time`` is imported as a module so tests can swap the clock.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import redis as redis_lib

from .. import telemetry as _telemetry
from ..db import prune as _prune
from ..db.dialect import check_engine
from ..errors import FencingConfigError, LeaseBackendError
from ..orm.flush import bind_lease
from . import lifecycle as steps
from .lifecycle import BaseLease, FencerCore, log  # (its logger is this module's name)
from .redis_client import probe_speaks

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session, scoped_session

    from ..db.prune import PruneResult

S = TypeVar("S", bound="Session | scoped_session[Any] | AsyncSession")
#: ``on_lost(lease)``: runs once, on the thread that first sees the loss.
OnLost = Callable[["Lease"], object]


class Lease(BaseLease["Fencer"]):
    """A granted lease: ``name``, ``owner``, ``token``, ``ttl``.  Bind it to sessions with
    :meth:`bind`, keep it alive with :meth:`extend` (or ``renew=True`` at acquire), ask whether it
    is still usable with :meth:`check` or :attr:`lost`, give it back with :meth:`release` (or use
    it as a context manager)."""

    _renew_entry: Entry | None = None  # the renewer's entry for its next renewal

    def extend(self, ttl: float | None = None) -> None:
        """Set the lease's remaining time to ``ttl`` seconds (default: the original ttl).

        Owner-checked: raises :class:`~sa_fence.LeaseLostError` (and marks the lease lost) when it
        expired or another owner holds it, :class:`~sa_fence.LeaseBackendError` when Redis did not
        answer within the failure budget, :class:`~sa_fence.FencingConfigError` when it refused the
        set-up (e.g. the ACL lacks ``PEXPIRE``).
        """
        steps.extend(self, ttl)

    @_telemetry.traced_release
    def release(self) -> bool:
        """Give the lease back; never deletes another owner's lease.  Idempotent; stops renewal
        first.  True when this call deleted our live lease (a resend finding the key gone within
        the local validity counts: only our delete can have removed it), False when it had already
        expired, been taken over, or been released, and in a forked child for a lease its parent
        was granted (the parent's to release).  Raises :class:`~sa_fence.LeaseBackendError`
        or :class:`~sa_fence.FencingConfigError` as :meth:`extend` does; the TTL then ends it."""
        with self._lock:
            if self._state.released:
                return False
            self._state.released = True
            renewing, self._state.renewing = self._state.renewing, False
        if renewing:  # (a lost lease's renewal was stopped when it was lost)
            self._stop_renewal()
        if self._forks != steps.forks:  # a forked child leaving its parent's `with` block
            log.warning(
                "lease %r (token %d) was granted to the parent of this forked process, which "
                "holds and releases it: not released in Redis by the child",
                self.name,
                self.token,
            )
            return False
        return self._release_in_redis()

    def bind(self, session: S) -> S:
        """Fence ``session``'s flushes with this lease's token from now on; returns ``session``,
        which (or whose class or sessionmaker) must have the flush hook (:func:`sa_fence.install`).
        A ``scoped_session`` binds its current session.  A released lease raises
        :class:`~sa_fence.LeaseLostError`.

        An ``AsyncSession`` is fenced as by an :class:`~sa_fence.AsyncLease` (its sync session is
        bound): binding and the flush's checks of the lease make no I/O of their own, and
        PostgreSQL checks the COMMIT against the register whichever front end drew the token
        (tests/lease/test_sync_lease_async_session.py).  But this lease's own calls (acquire,
        extend, release) block the event loop while they run: in asyncio code prefer
        :class:`~sa_fence.AsyncFencer` (docs/asyncio.md)."""
        if self._state.released:
            raise steps.released_error(self)
        bind_lease(session, self)  # type: ignore[arg-type]  # an AsyncSession is unwrapped
        return session

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.release()
        except (LeaseBackendError, FencingConfigError) as error:
            self._release_failed(error)

    def _start_renewal(self, at: float) -> None:
        with self._lock:  # release() and lose() clear renewing under it, then cancel the entry
            if self._state.renewing:
                self._renew_entry = self.fencer._renewals.add(at, _renew, weakref.ref(self))

    def _stop_renewal(self) -> None:
        self.fencer._renewals.cancel(self._renew_entry)


def _renew(ref: weakref.ref[Lease]) -> None:
    """A renewal due; the renewer holds the lease weakly (a dropped one expires)."""
    lease = ref()
    if lease is not None and (at := steps.renew(lease)) is not None:  # (it never raises)
        lease._start_renewal(at)


Entry = tuple[float, int, Callable[..., object], tuple[object, ...]]  # (when, seq, action, args)


class Deadlines:
    """Runs actions at monotonic deadlines on one daemon thread, started by the first entry
    and gone once none is pending: a fencer's renewer, and ``@fenced``'s ``max_hold``.
    Not :mod:`sched`, which wakes for an earlier entry only through a sleep of its user's."""

    def __init__(self, thread_name: str) -> None:
        self._name = thread_name
        self.reset()
        _every_deadlines.add(self)

    def reset(self) -> None:
        """No thread and no entries, as a forked child starts: the parent renews its leases."""
        self._cond = threading.Condition()
        self._heap: list[Entry] = []
        self._live: set[int] = set()  # seqs of entries not cancelled: a cancel is O(1)
        self._seq = itertools.count()  # orders entries of the same deadline
        self._thread: threading.Thread | None = None

    def add(self, at: float, action: Callable[..., object], *args: object) -> Entry:
        entry = (at, next(self._seq), action, args)
        with self._cond:
            heapq.heappush(self._heap, entry)
            self._live.add(entry[1])
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return entry

    def cancel(self, entry: Entry | None) -> None:
        with self._cond:
            if entry is not None and entry[1] in self._live:  # (not once it ran)
                self._live.discard(entry[1])  # skipped when it comes due
                if not self._live:
                    self._heap.clear()
                self._cond.notify()  # the thread ends if it was the last

    def _next_due(self) -> Entry | None:
        """Wait for the next entry that is due and take it; None once none is pending."""
        with self._cond:
            while self._heap:
                if self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)  # cancelled
                    continue
                delay = self._heap[0][0] - time.monotonic()
                if delay <= 0:
                    self._live.discard(self._heap[0][1])
                    return heapq.heappop(self._heap)
                self._cond.wait(delay)
            self._thread = None  # add() starts a new thread from now on
            return None

    def _run(self) -> None:
        while (entry := self._next_due()) is not None:
            _, _, action, args = entry
            try:
                action(*args)
            except Exception:  # (none is expected) one failure must not stall the others
                log.exception("sa-fence: a scheduled %s action failed", self._name)


_every_deadlines: weakref.WeakSet[Deadlines] = weakref.WeakSet()


def _reset_after_fork() -> None:  # in a forked child (Celery's prefork pool)
    for deadlines in list(_every_deadlines):
        deadlines.reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class Script:
    """A sync client's one-key script: EVALSHA by ``execute_command`` (far fewer calls than
    redis-py's ``Script``), loaded again after NOSCRIPT (a restarted or flushed server)."""

    def __init__(self, client: Any, script: str) -> None:
        self.client, self.script, self.sha = client, script, client.register_script(script).sha

    def __call__(self, keys: Any, args: Any) -> Any:
        try:
            return self.client.execute_command("EVALSHA", self.sha, 1, *keys, *args)
        except redis_lib.exceptions.NoScriptError:
            self.sha = self.client.script_load(self.script)
            return self.client.execute_command("EVALSHA", self.sha, 1, *keys, *args)


class Fencer(FencerCore["redis_lib.Redis | redis_lib.RedisCluster", "Engine", Lease]):
    """Grants leases (Redis) that carry fencing tokens (PostgreSQL sequence).

    ``redis``: a ``redis.Redis`` client; ``engine``: the engine of the database that holds the
    fenced rows *and* the token sequence.  Leases are stored under ``key_prefix + name``; renewed
    ones (``renew=True``) are extended after ``renew_fraction`` of their TTL by one background
    thread per Fencer, which runs only while such leases exist.

    ``timeout``: the failure budget in seconds (default 5) of one acquire (apart from waiting for a
    busy lease), extend, release or token draw on a failing Redis or PostgreSQL, a grant's wait for
    a committing holder included.  A failed call is sent at most three times, while the next one,
    as long as the last, ends within the budget: give the client a ``socket_timeout`` well below
    it.  Set-up mistakes (a wrong password or database index, TLS on one side only, a missing ACL
    right or register) are not resent: they raise :class:`~sa_fence.FencingConfigError`, with the
    fix.  ``telemetry``: where metrics and spans go and how lease names are shortened for them
    (:class:`~sa_fence.telemetry.Telemetry`; default: the global OpenTelemetry providers).
    """

    _kind = "Fencer"
    _renewer_word = "renewer"
    _lease_type = Lease

    def _start(self, redis: object, engine: Engine) -> Engine:
        if not isinstance(redis, redis_lib.Redis | redis_lib.RedisCluster):
            raise TypeError(
                "redis must be a sync redis.Redis or redis.RedisCluster client, got "
                f"{type(redis).__module__}.{type(redis).__name__}"
            )
        self.engine = check_engine(engine)
        self._check_lock = threading.Lock()
        self._renewals = Deadlines("sa-fence-renewer")
        return self.engine

    def check(self) -> None:
        """Check the token sequence and ``synchronous_commit`` now (it runs by itself before
        the first token); raises :class:`~sa_fence.FencingConfigError` with the fix."""
        with self._check_lock:
            self._tokens.check()

    def prune(
        self,
        *,
        older_than: float | timedelta,
        longest_lease: float | timedelta,
        dry_run: bool = False,
    ) -> PruneResult:
        """Delete the lease register's rows of names no one holds in Redis, last granted more
        than ``older_than`` ago (seconds, or a ``timedelta``); ``dry_run`` only reports them.

        ``longest_lease``: the longest a lease of yours lasts from its grant to its last commit
        (an ``older_than`` below it raises ValueError).  A row goes only while it holds the token
        read (a grant in between survives); a stale holder of a pruned name is still refused at
        commit.  Returns a :class:`PruneResult`.  As ``sa-fence prune`` (docs/operations.md).
        """
        return _prune.prune(
            self.engine,
            _prune.redis_held(self.redis, self.key_prefix),
            self.sequence,
            older_than=older_than,
            longest_lease=longest_lease,
            dry_run=dry_run,
        )

    def close(self) -> None:
        """Close the server connection this fencer holds for drawing tokens (which
        ``engine.dispose()`` does not reach; garbage collection does).  Granted leases keep
        working, and the fencer stays usable: the next token opens a new connection."""
        self._tokens.close()

    @_telemetry.traced_acquire
    def acquire(
        self,
        name: str,
        ttl: float,
        *,
        blocking: bool = False,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: OnLost | None = None,
        fail_fast: bool | None = None,
    ) -> Lease:
        """Take lease ``name`` for ``ttl`` seconds and draw its token: ``lease =
        fencer.acquire(...)``, released with ``lease.release()``, or ``with fencer.acquire(...)
        as lease:``, which releases on exit (if Redis cannot be reached then, a warning is
        logged instead: the lease's TTL ends it).

        ``blocking=True`` waits while another owner holds it, with exponential backoff and full
        jitter, for at most ``timeout`` seconds (default: ``ttl``).  ``renew=True`` keeps it alive
        in the background until it is released or lost; ``on_lost(lease)`` then runs once if it is
        lost.  ``fail_fast`` (default: ``renew``) makes bound sessions refuse to flush once the
        lease's local validity has passed.

        Raises :class:`~sa_fence.LeaseNotAcquiredError` when another owner holds it (after the
        wait, if blocking), :class:`~sa_fence.LeaseBackendError` when Redis or PostgreSQL did not
        answer within the failure budget or is failing over (what was set is removed if possible),
        :class:`~sa_fence.LeaseLostError` when the lease expired before its token was recorded, and
        :class:`~sa_fence.FencingConfigError`, with the fix, when the set-up is wrong (a missing or
        unfit sequence or register, a refused login or ACL right, TLS on one side only).
        """
        return steps.acquire(self, name, ttl, blocking, timeout, renew, on_lost, fail_fast)

    # ------------------------------------------------------ I/O (see lease.lifecycle)

    def _next_token(self, name: str) -> int:
        return self._tokens.next_token(name)

    _io = staticmethod(lambda result: result)  # the call was made already
    _sleep = staticmethod(lambda seconds: time.sleep(seconds))  # (tests swap the clock)
    _probe = staticmethod(probe_speaks)
    _script = Script
