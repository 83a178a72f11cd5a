"""Leases in Redis with tokens from PostgreSQL: :class:`Fencer` and :class:`Lease`.

The sync driver of the lease lifecycle in :mod:`sa_fence._lifecycle`: it
makes each call when the lifecycle asks for it, sleeps with ``time.sleep``
and renews leases on one thread per fencer.  :class:`BaseLease`, what a
holder knows about its lease without I/O, serves both front ends.  ``time``
and ``random`` are imported as modules so tests can swap the clock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import redis as redis_lib

from . import _lifecycle as steps
from . import _protocol as proto
from . import _prune, _telemetry
from ._dialect import check_engine
from ._failures import FAILOVER, cause_text, classify_redis
from ._flush import bind_lease
from ._lease_view import FencerView
from ._lifecycle import (  # re-exported: imported from here elsewhere
    DEFAULT_KEY_PREFIX as DEFAULT_KEY_PREFIX,
)
from ._lifecycle import FencerCore
from ._redis_client import probe_speaks
from .errors import FencingConfigError, LeaseBackendError, LeaseLostError

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, scoped_session

    from ._prune import PruneResult

log = logging.getLogger(__name__)  # a child of "sa_fence"

T = TypeVar("T")
S = TypeVar("S", bound="Session | scoped_session[Any]")
#: ``on_lost(lease)``: runs once, on the thread that first sees the loss.
OnLost = Callable[["Lease"], object]


class Fencer(FencerCore["redis_lib.Redis | redis_lib.RedisCluster", "Engine"]):
    """Grants leases (Redis) that carry fencing tokens (PostgreSQL sequence).

    ``redis`` is a ``redis.Redis`` client; ``engine`` is the SQLAlchemy engine
    of the database that holds the fenced rows *and* the token sequence.
    Leases are stored under ``key_prefix + name``.  Renewed leases
    (``renew=True``) are extended after ``renew_fraction`` of their TTL by
    one background thread per Fencer, which runs only while such leases exist.

    ``timeout`` is the failure budget in seconds (default 5): how long one
    acquire (apart from waiting for a busy lease, which ``blocking`` and its
    ``timeout`` bound), extend, release or token draw may spend on a failing
    Redis or PostgreSQL before it gives up.  A failed call is resent only
    while the next attempt, judged by the last one, ends within the budget,
    and at most three times; a single call lasts as long as the client lets
    it (its ``socket_timeout`` and its own ``retry``), so give the client a
    ``socket_timeout`` well below the budget.  The same budget bounds a
    grant's wait for a holder that is committing (the register row's lock).
    Set-up mistakes (a wrong password or database index, TLS on one side
    only, a missing ACL right, a missing register) are not resent: they raise
    :class:`~sa_fence.FencingConfigError` at once, with the fix.

    ``telemetry``: where metrics and spans go, and how lease names are
    shortened for them (:class:`~sa_fence.telemetry.Telemetry`); default: the global
    OpenTelemetry providers (no-ops without an SDK).  See docs/observability.md.
    """

    _log = log
    _kind = "Fencer"
    _renewer_word = "renewer"

    def _start(self, redis: object, engine: Engine) -> Engine:
        if not isinstance(redis, redis_lib.Redis | redis_lib.RedisCluster):
            raise TypeError(
                "redis must be a sync redis.Redis or redis.RedisCluster client, got "
                f"{type(redis).__module__}.{type(redis).__name__}"
            )
        self.engine = check_engine(engine)
        self._check_lock = threading.Lock()
        self._renewer = _Renewer()
        return self.engine

    def check(self) -> None:
        """Check the token sequence and ``synchronous_commit`` now.

        Runs automatically before the first token; raises
        :class:`~sa_fence.FencingConfigError` saying how to fix what is wrong.
        """
        with self._check_lock:
            self._tokens.check()

    def prune(
        self,
        *,
        older_than: float | timedelta,
        longest_lease: float | timedelta,
        dry_run: bool = False,
    ) -> PruneResult:
        """Delete the lease register's rows of names that no one holds and that were
        last granted more than ``older_than`` ago (seconds, or a ``timedelta``).

        ``longest_lease`` is the longest a lease of yours can last from its grant
        to its last commit (renewals included), a bound only you know; an
        ``older_than`` shorter than it raises ValueError.  A name held in Redis
        now is kept whatever its age, and a row is deleted only while it still
        holds the token read (a grant in between survives).  A stale holder of
        a pruned name is still refused at commit.  ``dry_run`` deletes nothing
        and reports what would go.  Returns a :class:`PruneResult` (rows and
        bytes removed).  ``sa-fence prune`` does the same from the command line;
        see docs/operations.md#retention.
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
        """Close the server connection this fencer holds for drawing tokens.

        ``engine.dispose()`` does not reach it (sa-fence adds no listener to
        your Engine); garbage collection does, and so does this.  Leases
        already granted keep working, and the fencer stays usable: the next
        token opens a new connection.
        """
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
        """Take lease ``name`` for ``ttl`` seconds and draw its token.

        ``blocking=True`` waits while another owner holds the lease, with
        exponential backoff and full jitter, for at most ``timeout`` seconds
        (default: ``ttl``) on the monotonic clock.  ``renew=True`` keeps the
        lease alive in the background until it is released or lost;
        ``on_lost(lease)`` then runs once if it is lost.  ``fail_fast``
        (default: ``renew``) makes bound sessions refuse to flush once the
        lease's local validity has passed.

        Raises :class:`~sa_fence.LeaseNotAcquiredError` when another owner
        holds it (after the wait, if blocking), :class:`~sa_fence.LeaseBackendError`
        when Redis or PostgreSQL did not answer within the fencer's failure
        budget (``timeout``) or is failing over (any lease left behind is
        removed if possible), :class:`~sa_fence.LeaseLostError` when the lease
        expired before its token could be recorded (the token is thrown away),
        and :class:`~sa_fence.FencingConfigError` when the set-up is wrong: the
        sequence or register is missing or unfit, a login or ACL right is
        refused, TLS is on one side only (checked before anything is written).
        """
        lease: Lease = steps.acquire(self, name, ttl, blocking, timeout, renew, on_lost, fail_fast)
        return lease

    @contextmanager
    def lease(
        self,
        name: str,
        ttl: float,
        *,
        blocking: bool = False,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: OnLost | None = None,
        fail_fast: bool | None = None,
    ) -> Iterator[Lease]:
        """``with fencer.lease(name, ttl) as lease:`` acquires, then releases on exit.

        Takes the same arguments as :meth:`acquire`.  The body never runs
        without the lease.  If Redis cannot be reached to release it, a
        warning is logged instead of raising: the lease's TTL ends it.
        """
        lease = self.acquire(
            name,
            ttl,
            blocking=blocking,
            timeout=timeout,
            renew=renew,
            on_lost=on_lost,
            fail_fast=fail_fast,
        )
        try:
            yield lease
        finally:
            lease._release_on_exit()

    # ------------------------------------------------------ I/O (see _lifecycle)

    def _next_token(self, name: str) -> int:
        return self._tokens.next_token(name)

    def _release_quietly(self, key: str, values: list[str]) -> None:
        steps.release_quietly(self, key, values)

    @staticmethod
    def _io(result: T) -> T:
        return result  # the call was made already

    @staticmethod
    def _sleep(seconds: float) -> None:
        time.sleep(seconds)

    _probe = staticmethod(probe_speaks)


class _Renewer:
    """One thread per Fencer that extends renewed leases when they fall due.

    A single thread with a heap of deadlines keeps the thread count bounded
    (1,000 renewed leases cost one thread, not 1,000) and needs no joins on
    the release path.  Its cost: renewals are sent one after another, so one
    slow Redis call delays the others; they share one Redis client, so Redis
    being slow for one lease means slow for all, and each renewal leaves the
    rest of the TTL (2/3 by default) as slack.  The thread starts with the
    first renewed lease and exits as soon as none is scheduled.  It holds
    leases only weakly: a Lease dropped without release stops being renewed
    and expires in Redis, so renewal never outlives its lease.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, weakref.ref[Lease]]] = []
        self._wanted: set[int] = set()  # entries still scheduled (not cancelled)
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, lease: Lease, at: float) -> None:
        with self._cond:
            with lease._lock:  # release() clears this first, then cancels under _cond
                if not lease._state.renewing:
                    return
            seq = next(self._seq)
            lease._renew_entry = seq
            heapq.heappush(self._heap, (at, seq, weakref.ref(lease)))
            self._wanted.add(seq)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="sa-fence-renewer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def cancel(self, lease: Lease) -> None:
        with self._cond:
            if lease._renew_entry is not None:
                self._wanted.discard(lease._renew_entry)
                lease._renew_entry = None
            if not self._wanted:
                self._heap.clear()
            self._cond.notify()

    def _next_due(self) -> Lease | None:
        """Wait for the next lease that is due; None when nothing is scheduled."""
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._wanted:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._thread = None
                    return None
                at, seq, ref = self._heap[0]
                now = time.monotonic()
                if at > now:
                    self._cond.wait(at - now)
                    continue
                heapq.heappop(self._heap)
                self._wanted.discard(seq)
                lease = ref()
                if lease is None or lease._renew_entry != seq:
                    continue
                lease._renew_entry = None
                return lease

    def _run(self) -> None:
        while (lease := self._next_due()) is not None:
            try:
                at = steps.renew(lease)
            except Exception as exc:  # never stop silently, never stop the others
                lease._renewal_crashed(exc)
                at = None
            if at is not None:
                self.schedule(lease, at)
            del lease


FencerT = TypeVar("FencerT", bound=FencerView)

#: Fencers that already logged "a lease was released without being bound".
_warned_unbound: weakref.WeakSet[Any] = weakref.WeakSet()


def _warn_never_bound(lease: BaseLease[Any]) -> None:
    """A lease held around writes that nothing fenced: say so once per Fencer.

    Release is the one cheap place that sees it: a session with no hook
    installed runs no sa-fence code at all, but a lease that was never bound
    (``lease.bind()``, ``fence_connection()`` or the decorator) fenced
    nothing that was written while it was held.
    """
    if lease.fencer in _warned_unbound:
        return
    _warned_unbound.add(lease.fencer)
    log.warning(
        "lease %r (token %d) was released without having been bound to a session or "
        "connection, so nothing written while it was held was fenced by it. Bind it to "
        "each session that writes under it (lease.bind(session), on a session whose "
        "sessionmaker has sa_fence.install()), or use @sa_fence.fenced, which binds for "
        "you. If you only use the lease's token (an idempotency key), ignore this; it "
        "is logged once per Fencer.",
        lease.name,
        lease.token,
        extra=_telemetry.log_extra(lease, "never_bound"),
    )


class BaseLease(Generic[FencerT]):
    """What a holder knows about a granted lease, without I/O.

    Shared by :class:`Lease` and :class:`sa_fence.AsyncLease` (and read by the
    flush hook): the state, the validity on this process's monotonic clock,
    and the "is it still usable" checks.  The subclasses add the Redis calls.
    """

    #: Set once the lease is bound to a session or connection (see _warn_never_bound).
    _bound: bool = False
    #: The front end's logger (for what only one front end logs).
    _log = log
    #: What the lease reports its metrics under (set at acquire; see _telemetry).
    _tel: _telemetry.LeaseTelemetry | None = None

    def __init__(
        self,
        fencer: FencerT,
        name: str,
        key: str,
        owner: str,
        token: int,
        ttl: float,
        value: str,
        acquired_at: float,
        *,
        ttl_ms: int | None = None,
        fail_fast: bool = False,
        on_lost: Callable[[Any], object] | None = None,
    ) -> None:
        self.fencer = fencer
        self.name = name
        self.key = key
        self.owner = owner
        self.token = token
        self.ttl = ttl
        self._value = value
        self.acquired_at = acquired_at
        self._ttl_ms = proto.ttl_to_ms(ttl) if ttl_ms is None else ttl_ms
        self._lock = threading.Lock()
        self._state = proto.LeaseState(
            name=name,
            token=token,
            valid_until=proto.valid_until(acquired_at, self._ttl_ms),
            fail_fast=fail_fast,
        )
        self._on_lost = on_lost
        self._renew_failures = 0

    def __repr__(self) -> str:
        state = "released" if self.released else "lost" if self.lost else "held"
        return f"<{type(self).__name__} {self.name!r} token={self.token} ttl={self.ttl} {state}>"

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._state.released

    @property
    def lost(self) -> bool:
        """True once the lease is known to be gone.

        Set when renewal or :meth:`extend` found another owner or no lease,
        or when a renewed lease's local validity ran out without a successful
        renewal.  Never goes back to False.
        """
        self._notice_overdue()
        return self._state.lost is not None

    def remaining(self) -> float:
        """Seconds of local validity left (0.0 once passed), on the monotonic clock.

        The lease is surely still ours in Redis before this runs out (unless
        someone deleted the key); after it, it may be another owner's.
        """
        return max(0.0, self._state.valid_until - time.monotonic())

    def check(self) -> None:
        """Raise :class:`~sa_fence.LeaseLostError` unless the lease is still usable.

        Usable: not released, not lost, and within its local validity.  No
        round trip to Redis: call it between steps of long work.
        """
        self._notice_overdue()
        problem = self._state.problem(time.monotonic(), for_write=False)
        if problem is not None:
            raise LeaseLostError(problem)

    def _check_for_write(self) -> None:
        """The flush's check: like :meth:`check`, validity only with ``fail_fast``."""
        state = self._state  # the hot path (every fenced flush and statement): no calls
        if not (state.released or state.lost is not None) and (
            not (state.renewing or state.fail_fast) or time.monotonic() < state.valid_until
        ):
            return
        self._notice_overdue()
        problem = self._state.problem(time.monotonic(), for_write=True)
        if problem is not None:
            raise LeaseLostError(problem)

    def _lose(self, message: str) -> None:
        with self._lock:
            first = self._state.mark_lost(message)
        if not first:
            return
        self._stop_renewal()
        _telemetry.lost(self)
        log.warning("%s", message, extra=_telemetry.log_extra(self, "lost"))
        if self._on_lost is not None:
            try:
                self._on_lost(self)
            except Exception:
                log.exception("on_lost callback of lease %r raised", self.name)
        self._after_lost()

    def _stop_renewal(self) -> None:
        """Stop renewing this lease (the front end's renewer)."""

    # What follows each Redis call of the lifecycle (sa_fence._lifecycle).

    def _release_outcome(self, deleted: bool, resent: bool, first_sent: float) -> bool:
        if not self._bound:
            _warn_never_bound(self)
        deleted = proto.release_deleted(
            self._state, deleted=deleted, resent=resent, first_sent=first_sent, now=time.monotonic()
        )
        _telemetry.released(self, deleted)
        if not deleted:
            log.warning(
                "lease %r (token %d) had already expired or been taken over at release",
                self.name,
                self.token,
                extra=_telemetry.log_extra(self, "expired"),
            )
        return deleted

    def _renewal_unanswered(self, exc: Exception) -> str:
        failure = classify_redis(exc)
        log.warning(
            "renewal of lease %r failed (%s)%s; retrying until its local validity runs out",
            self.name,
            failure.text,
            "; a failover may be under way" if failure.kind == FAILOVER else "",
            extra=_telemetry.log_extra(self, "renewal_failed"),
        )
        return "unknown"

    def _renewal_step(self, outcome: str, sent_at: float, fraction: float) -> float | None:
        """After one renewal EXTEND: the next due time, or None to stop (lost or released)."""
        _telemetry.renewal(self, outcome, sent_at)
        with self._lock:
            if not self._state.renewing:
                return None  # released (or lost) meanwhile: ignore the answer
            self._renew_failures = 0 if outcome != "unknown" else self._renew_failures + 1
            step = proto.after_renewal(
                self._state,
                outcome=outcome,
                now=time.monotonic(),
                sent_at=sent_at,
                ttl_ms=self._ttl_ms,
                fraction=fraction,
                failures=max(0, self._renew_failures - 1),
                rand=random.random(),
            )
        if step.lost is not None:
            self._lose(step.lost)
            return None
        return step.at

    def _renewal_crashed(self, exc: Exception) -> None:
        """A renewal failed in an unexpected way: never stop silently."""
        self._log.exception("renewal of lease %r failed unexpectedly", self.name)
        self._lose(
            f"lease {self.name!r} (token {self.token}) could not be renewed: "
            f"{type(exc).__name__}: {exc}. Stop the work; nothing was sent."
        )

    def _release_failed(self, exc: LeaseBackendError | FencingConfigError) -> None:
        """The release on leaving a ``with`` block failed: log it, the TTL ends the lease."""
        self._log.warning(
            "could not release lease %r (token %d): %s; its TTL will end it",
            self.name,
            self.token,
            cause_text(exc.cause) if exc.cause is not None else exc,
            extra=_telemetry.log_extra(self, "release_failed"),
        )

    def _after_lost(self) -> None:
        """Run after ``on_lost`` (the asyncio front end cancels fenced bodies here)."""

    def _notice_overdue(self) -> None:
        if self._state.overdue(time.monotonic()):
            self._lose(proto.renewal_timed_out_message(self.name, self.token))


class Lease(BaseLease["Fencer"]):
    """A granted lease: ``name``, ``owner``, ``token``, ``ttl``.

    Bind it to sessions with :meth:`bind`; keep it alive with :meth:`extend`
    (or ``renew=True`` at acquire); ask whether it is still usable with
    :meth:`check` or :attr:`lost`; give it back with :meth:`release` (or use
    it as a context manager).
    """

    #: The renewer's heap entry for this lease, while it is scheduled.
    _renew_entry: int | None = None

    def extend(self, ttl: float | None = None) -> None:
        """Set the lease's remaining time to ``ttl`` seconds (default: the original ttl).

        Owner-checked: raises :class:`~sa_fence.LeaseLostError` (and marks the
        lease lost) when the lease expired or another owner holds it; it is
        then never extended.  Raises :class:`~sa_fence.LeaseBackendError` when
        Redis did not answer within the fencer's failure budget (``timeout``),
        and :class:`~sa_fence.FencingConfigError` when it refused the set-up
        (e.g. the ACL lacks ``PEXPIRE``).
        """
        steps.extend(self, ttl)

    @_telemetry.traced_release
    def release(self) -> bool:
        """Give the lease back; never deletes another owner's lease.

        Idempotent; stops renewal first.  Returns True when this call deleted
        our live lease, False when it had already expired, been taken over,
        or been released.  A resend after a lost reply that finds the key gone
        counts as ours when the lease was still within its local validity
        (only our own delete can have removed it then).  Raises
        :class:`~sa_fence.LeaseBackendError` when Redis did not answer within
        the fencer's failure budget (``timeout``), and
        :class:`~sa_fence.FencingConfigError` when it refused the set-up; the
        lease's TTL then ends it.
        """
        with self._lock:
            if self._state.released:
                return False
            self._state.released = True
            renewing, self._state.renewing = self._state.renewing, False
        if renewing:  # (a lost lease's renewal was stopped when it was lost)
            self.fencer._renewer.cancel(self)
        return steps.release(self)

    def bind(self, session: S) -> S:
        """Fence ``session``'s flushes with this lease's token from now on.

        The session (or its class / sessionmaker) must have the flush hook:
        see :func:`sa_fence.install`.  A ``scoped_session`` binds its current
        session.  Returns ``session``.
        """
        bind_lease(session, self)
        return session

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release_on_exit()

    # ------------------------------------------------------------ internals

    def _release_on_exit(self) -> None:
        try:
            self.release()
        except (LeaseBackendError, FencingConfigError) as exc:
            self._release_failed(exc)

    def _start_renewal(self, at: float) -> None:
        self._state.renewing = True
        self.fencer._renewer.schedule(self, at)

    def _stop_renewal(self) -> None:
        self.fencer._renewer.cancel(self)


Fencer._lease_type = Lease
