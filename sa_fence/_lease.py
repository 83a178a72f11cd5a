"""Leases in Redis with tokens from PostgreSQL: :class:`Fencer` and :class:`Lease`.

This is the thin sync driver of :mod:`sa_fence._protocol`: it sends the
scripts, reads the clock, sleeps and runs the renewer thread; the decisions
(retry or give up, how long to wait, is the lease still valid, is it lost)
are pure functions there, so an asyncio front end can share them.  ``time``
and ``random`` are imported as modules so tests can swap the clock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import redis as redis_lib
from sqlalchemy.exc import SQLAlchemyError

from . import _protocol as proto
from . import _prune, _telemetry
from ._dialect import check_engine
from ._flush import bind_lease
from ._lease_view import FencerView
from ._tokens import DEFAULT_SEQUENCE, TokenSource, token_error
from .errors import (
    FenceError,
    FencingConfigError,
    LeaseBackendError,
    LeaseLostError,
    LeaseNotAcquiredError,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, scoped_session

    from ._prune import PruneResult

log = logging.getLogger(__name__)  # a child of "sa_fence"

DEFAULT_KEY_PREFIX = "sa_fence:"

#: Everything a Redis client raises for a failed call (cluster routing errors
#: such as SlotNotCoveredError are not RedisErrors).
REDIS_ERRORS = (redis_lib.exceptions.RedisError, redis_lib.exceptions.RedisClusterException)

T = TypeVar("T")
S = TypeVar("S", bound="Session | scoped_session[Any]")
#: ``on_lost(lease)``: runs once, on the thread that first sees the loss.
OnLost = Callable[["Lease"], object]

#: Marks "this client's socket_timeout could not be read" (e.g. a custom client class).
_UNKNOWN_TIMEOUT = object()


def client_socket_timeout(client: object) -> object:
    """The ``socket_timeout`` a (sync or asyncio) Redis or RedisCluster client's
    connections use: a number, None (no bound), or ``_UNKNOWN_TIMEOUT``."""
    for holder in (
        getattr(getattr(client, "connection_pool", None), "connection_kwargs", None),
        getattr(getattr(client, "nodes_manager", None), "connection_kwargs", None),
        getattr(client, "connection_kwargs", None),
    ):
        if isinstance(holder, dict):
            return holder.get("socket_timeout")
    return _UNKNOWN_TIMEOUT


def client_call_bound(client: object) -> tuple[float | None, str] | None:
    """The longest one call of a plain or Sentinel client can last, and how that
    comes about; None when it cannot be read (a cluster client, a custom class).

    redis-py connects with up to ``retries`` retries of its own (each up to
    ``socket_connect_timeout``, with waits of up to its backoff's cap), then
    sends and waits up to ``socket_timeout`` for the reply, and on a failure
    does it all again up to ``retries`` times.  With ``retry=Retry(NoBackoff(),
    0)`` one call is one connect and one wait.  The bound is None (unbounded)
    without a socket timeout or with endless retries.
    """
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return None
    read = kwargs.get("socket_timeout")
    connect = kwargs.get("socket_connect_timeout") or read
    retry = kwargs.get("retry")
    retries = retry.get_retries() if retry is not None else 0
    backoff = getattr(retry, "_backoff", None)
    cap = 0.0 if backoff is None else getattr(backoff, "_cap", getattr(backoff, "_backoff", None))
    how = (
        f"socket_timeout={read}, socket_connect_timeout={connect}, {retries} retries of "
        f"its own with waits of up to {cap} s"
    )
    if read is None or connect is None or retries < 0:
        return None, how
    if not isinstance(cap, int | float):
        return None
    connecting = (retries + 1) * float(connect) + retries * float(cap)
    return connecting + float(read) + retries * (connecting + float(read) + float(cap)), how


def check_budget(client: object, timeout: float | None, owner: str) -> float:
    """The failure budget for ``owner`` (a Fencer): ``timeout`` or the default.

    An explicit budget that one call of the client could outlast (no socket
    timeout, or redis-py's own retries and backoff adding up to more) is
    refused: sa-fence cannot interrupt a call in progress, so it asks for a
    client that keeps the budget.  The default budget is not checked this
    way: it bounds sa-fence's own resends (see the Fencer's docstring).
    """
    if timeout is None:
        return proto.DEFAULT_BACKEND_TIMEOUT
    budget = proto.check_backend_timeout(timeout)
    found = client_call_bound(client)
    unbounded = client_socket_timeout(client) is None
    if unbounded or (found is not None and (found[0] is None or found[0] > budget)):
        longest = (
            "unbounded"
            if unbounded or found is None or found[0] is None
            else (f"up to {found[0]:.3g} s")
        )
        how = f" ({found[1]})" if found is not None else ""
        third = budget / 3
        raise FencingConfigError(
            f"{owner}(timeout={timeout!r}) cannot keep its budget: one call of this Redis "
            f"client can last {longest}{how}, and a call in progress cannot be cut short. "
            "Create the client with socket timeouts well below the budget and few retries "
            "of its own (sa-fence resends what is safe to resend, within the budget), e.g. "
            f"redis.Redis(..., socket_timeout={third:.3g}, socket_connect_timeout="
            f"{third:.3g}, retry=Retry(NoBackoff(), 0)); see {proto.TIMEOUTS_DOC}."
        )
    return budget


def lock_timeout_ms(budget: float) -> int:
    """The register's lock wait bound for a failure budget (the same seconds)."""
    return max(1, math.ceil(budget * 1000))


def probe_target(client: object) -> tuple[str, int, bool] | None:
    """(host, port, tls) of a plain (non-Sentinel, non-Cluster) client, else None."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict) or "Sentinel" in type(pool).__name__:
        return None
    host, port = kwargs.get("host"), kwargs.get("port", 6379)
    if not isinstance(host, str) or not isinstance(port, int):
        return None  # a Unix socket: no TLS to disagree about
    tls = "SSL" in getattr(getattr(pool, "connection_class", None), "__name__", "")
    return host, port, tls


def probe_speaks(host: str, port: int, timeout: float = 0.5) -> str | None:
    """What the server on ``host:port`` speaks: "plain" (RESP), "tls", or None
    (no answer).  Used only after a connection failed, to tell a TLS mismatch
    (a set-up mistake) from an outage: a plain Redis answers ``PING`` in RESP,
    a TLS port closes the connection or answers with a TLS alert."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            data = sock.recv(16)
    except ConnectionResetError:
        return "tls"
    except OSError:
        return None
    if not data or data[:1] in (b"\x15", b"\x16"):
        return "tls"
    if data[:1] in (b"+", b"-"):
        return "plain"
    return None


def redis_error(
    name: str,
    operation: str,
    exc: BaseException,
    attempts: int,
    *,
    target: tuple[str, int, bool] | None = None,
    speaks: str | None = None,
) -> FenceError:
    """The error to raise for a Redis call that failed for good (shared by both front ends)."""
    failure = proto.classify_redis(exc, speaks=speaks, tls=bool(target and target[2]))
    if failure.kind == proto.SETUP:
        where = f" at {target[0]}:{target[1]}" if target else ""
        return FencingConfigError(
            f"{operation} of lease {name!r} failed{where}: {failure.text}", cause=exc
        )
    return LeaseBackendError(
        backend="redis",
        operation=operation,
        name=name,
        cause=exc,
        detail=proto.outage_detail("Redis", failure, attempts),
    )


class Fencer:
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
    shortened for them (:class:`~sa_fence.Telemetry`); default: the global
    OpenTelemetry providers (no-ops without an SDK).  See docs/observability.md.
    """

    def __init__(
        self,
        redis: redis_lib.Redis | redis_lib.RedisCluster,
        engine: Engine,
        *,
        sequence: str = DEFAULT_SEQUENCE,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        renew_fraction: float = proto.DEFAULT_RENEW_FRACTION,
        timeout: float | None = None,
        telemetry: _telemetry.Telemetry | None = None,
    ) -> None:
        if not isinstance(redis, redis_lib.Redis | redis_lib.RedisCluster):
            raise TypeError(
                "redis must be a sync redis.Redis or redis.RedisCluster client, got "
                f"{type(redis).__module__}.{type(redis).__name__}"
            )
        if not isinstance(sequence, str) or not sequence:
            raise ValueError("sequence must be the (optionally schema-qualified) sequence name")
        self.redis = redis
        self.engine = check_engine(engine)
        self.key_prefix = proto.check_prefix(key_prefix)
        self.renew_fraction = proto.check_renew_fraction(renew_fraction)
        #: the failure budget, in seconds (see the class docstring)
        self.timeout = check_budget(redis, timeout, "Fencer")
        self._tokens = TokenSource(engine, sequence, lock_timeout_ms=lock_timeout_ms(self.timeout))
        self._check_lock = threading.Lock()
        self._acquire = redis.register_script(proto.ACQUIRE_SCRIPT)
        self._confirm = redis.register_script(proto.CONFIRM_SCRIPT)
        self._extend = redis.register_script(proto.EXTEND_SCRIPT)
        self._release = redis.register_script(proto.RELEASE_SCRIPT)
        self._renewer = _Renewer()
        self._warned_no_timeout = False
        #: where metrics and spans go (None: the global providers; docs/observability.md)
        self._telemetry = telemetry

    @property
    def sequence(self) -> str:
        return self._tokens.sequence

    # Package-internal (no docstring, so not on the API page): the flush hook
    # reads the register and the database's identity of this fencer's tokens.
    @property
    def token_source(self) -> TokenSource:
        return self._tokens

    def key(self, name: str) -> str:
        """The Redis key that holds lease ``name``."""
        return self.key_prefix + proto.check_name(name)

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
        key = self.key(name)
        ttl_ms = proto.ttl_to_ms(ttl)
        max_wait = proto.check_timeout(blocking, timeout, float(ttl))
        proto.check_lease_options(renew, on_lost, fail_fast)
        if not self._tokens.checked:
            try:
                self.check()
            except SQLAlchemyError as exc:
                # the chain adds nothing to the error's own cause (its .cause)
                raise token_error(
                    name,
                    exc,
                    self._tokens.lock_timeout_ms,
                    operation="check",
                    sequence=self.sequence,
                ) from None
        if renew:
            self._warn_if_unbounded()
        owner = proto.new_owner()
        started = self._grant(name, key, owner, ttl_ms, max_wait)
        try:
            token = self._tokens.next_token(name)
        except SQLAlchemyError as exc:
            self._release_quietly(key, owner)
            raise token_error(
                name, exc, self._tokens.lock_timeout_ms, sequence=self.sequence
            ) from None
        except BaseException:
            self._release_quietly(key, owner)
            raise
        value = proto.confirmed_value(owner, token)
        try:
            remaining = int(
                self._call(name, "confirm", lambda: self._confirm(keys=[key], args=[owner, value]))
            )
        except FenceError:
            self._release_quietly(key, value, owner)
            raise
        if remaining < 0:
            # Lost before the token was confirmed: the token was never used, so
            # the register goes back to the live holder's (if it still holds ours).
            self._tokens.withdraw(name, token)
            raise LeaseLostError(proto.confirm_lost_message(name, token))
        lease = Lease(
            self,
            name,
            key,
            owner,
            token,
            ttl,
            value,
            started,
            ttl_ms=ttl_ms,
            fail_fast=renew if fail_fast is None else fail_fast,
            on_lost=on_lost,
        )
        if renew:
            lease._state.renewing = True
            self._renewer.schedule(lease, started + self.renew_fraction * ttl_ms / 1000)
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

    # ------------------------------------------------------------------ I/O

    def _grant(self, name: str, key: str, owner: str, ttl_ms: int, max_wait: float) -> float:
        """Run ACQUIRE until granted; return the monotonic time validity counts from."""
        attempts = proto.AcquireAttempts(
            deadline=time.monotonic() + max_wait, failed=proto.FailureBudget(self.timeout)
        )
        waited_from = time.monotonic()
        while True:
            sent_at = time.monotonic()
            try:
                reply = self._acquire(keys=[key], args=[owner, ttl_ms])
            except REDIS_ERRORS as exc:
                failure = proto.classify_redis(exc)
                wait = attempts.on_failure(
                    failure, sent_at=sent_at, now=time.monotonic(), rand=random.random()
                )
                if wait is None:
                    # Not "acquired", not "not acquired".  Remove what a lost
                    # ACQUIRE may have set (the TTL ends it otherwise): not after
                    # a failure that proves nothing was set, nor when the call
                    # would not end within the budget (a Redis that stopped).
                    if attempts.unknown_since is not None and attempts.failed.fits_another(
                        time.monotonic()
                    ):
                        self._release_quietly(key, owner)
                    raise self._error(name, "acquire", exc, attempts.failed) from None
                time.sleep(wait)
                continue
            outcome, holder_token = proto.parse_acquire_reply(reply)
            if outcome != proto.HELD:
                return attempts.sent(sent_at)
            wait = attempts.on_held(time.monotonic(), random.random())
            if wait is None:
                waited = time.monotonic() - waited_from if max_wait > 0 else None
                raise LeaseNotAcquiredError(name, holder_token, waited=waited)
            time.sleep(wait)

    def _call(self, name: str, operation: str, do: Callable[[], T]) -> T:
        """Send an idempotent script call; resend it within the failure budget while
        it fails in a way a resend may fix; then raise the error for the failure."""
        return self._call_counting(name, operation, do)[0]

    def _call_counting(self, name: str, operation: str, do: Callable[[], T]) -> tuple[T, int]:
        """As :meth:`_call`; also how many sends failed before the one that answered."""
        budget = proto.FailureBudget(self.timeout)
        while True:
            sent_at = time.monotonic()
            try:
                return do(), budget.failures
            except REDIS_ERRORS as exc:
                wait = budget.on_failure(
                    proto.classify_redis(exc),
                    sent_at=sent_at,
                    now=time.monotonic(),
                    rand=random.random(),
                )
                if wait is None:
                    raise self._error(name, operation, exc, budget) from None
                time.sleep(wait)

    def _error(
        self, name: str, operation: str, exc: BaseException, budget: proto.FailureBudget
    ) -> FenceError:
        """The error for a Redis call that failed for good; probes the server first
        (within what is left of the budget) when the connection failed before
        anything was sent: TLS on one side only looks like an outage."""
        target = probe_target(self.redis)
        speaks = None
        if target is not None and proto.wants_probe(proto.classify_redis(exc)):
            wait = proto.probe_timeout(budget.remaining(time.monotonic()))
            speaks = probe_speaks(target[0], target[1], wait)
        return redis_error(name, operation, exc, budget.failures, target=target, speaks=speaks)

    def _release_quietly(self, key: str, *values: str) -> None:
        """Owner-checked clean-up after a failed acquire: one attempt per value.

        The original error matters more and the lease's TTL ends the lease
        anyway, so a clean-up that fails too (Redis is down) is logged at
        debug level only.
        """
        for value in values:
            try:
                self._release(keys=[key], args=[value])
            except REDIS_ERRORS as exc:
                log.debug(
                    "could not remove lease %s after a failed acquire (%s); its TTL ends it",
                    key,
                    proto.cause_text(exc),
                )
                return

    def _warn_if_unbounded(self) -> None:
        if self._warned_no_timeout:
            return
        if client_socket_timeout(self.redis) is None:
            self._warned_no_timeout = True
            log.warning(
                "renewed leases on a Redis client without socket_timeout: a Redis that "
                "stops answering blocks the renewer until the OS gives up, so on_lost "
                "runs late (lease.lost and the flush check still use the local clock). "
                "Create the client with socket_timeout=<seconds well below the TTL>."
            )


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
                at = lease._renew_once()
            except Exception as exc:  # never stop silently, never stop the others
                log.exception("renewal of lease %r failed unexpectedly", lease.name)
                lease._lose(
                    f"lease {lease.name!r} (token {lease.token}) could not be renewed: "
                    f"{type(exc).__name__}: {exc}. Stop the work; nothing was sent."
                )
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

    # The decisions around each Redis call, shared by both front ends: they
    # differ only in how they send the call and wait.

    def _extend_ttl_ms(self, ttl: float | None) -> int:
        """Validate an extend before sending it: the TTL in ms, or LeaseLostError."""
        ttl_ms = proto.ttl_to_ms(self.ttl if ttl is None else ttl)
        problem = self._state.problem(time.monotonic(), for_write=True)
        if problem is not None and (self.released or self._state.lost is not None):
            raise LeaseLostError(problem)
        return ttl_ms

    def _on_extend_reply(self, extended: int, sent_at: float, ttl_ms: int) -> None:
        if not extended:
            message = proto.not_ours_message(self.name, self.token)
            self._lose(message)
            raise LeaseLostError(message)
        with self._lock:
            self._state.on_extended(sent_at, ttl_ms)

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
        failure = proto.classify_redis(exc)
        log.warning(
            "renewal of lease %r failed (%s)%s; retrying until its local validity runs out",
            self.name,
            failure.text,
            "; a failover may be under way" if failure.kind == proto.FAILOVER else "",
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
        ttl_ms = self._extend_ttl_ms(ttl)
        sent_at = time.monotonic()
        extended = int(
            self.fencer._call(
                self.name,
                "extend",
                lambda: self.fencer._extend(keys=[self.key], args=[self._value, ttl_ms]),
            )
        )
        self._on_extend_reply(extended, sent_at, ttl_ms)

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
            self._state.renewing = False
        self.fencer._renewer.cancel(self)
        fencer = self.fencer
        first_sent = time.monotonic()
        reply, failures = fencer._call_counting(
            self.name, "release", lambda: fencer._release(keys=[self.key], args=[self._value])
        )
        return self._release_outcome(bool(int(reply)), failures > 0, first_sent)

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
            log.warning(
                "could not release lease %r (token %d): %s; its TTL will end it",
                self.name,
                self.token,
                proto.cause_text(exc.cause) if exc.cause is not None else exc,
                extra=_telemetry.log_extra(self, "release_failed"),
            )

    def _stop_renewal(self) -> None:
        self.fencer._renewer.cancel(self)

    def _renew_once(self) -> float | None:
        """One renewal (on the renewer thread); the next due time, or None to stop."""
        with self._lock:
            if not self._state.renewing:
                return None
        sent_at = time.monotonic()
        try:
            reply = int(self.fencer._extend(keys=[self.key], args=[self._value, self._ttl_ms]))
            outcome = "extended" if reply else "not-ours"
        except REDIS_ERRORS as exc:  # timeouts, a read-only replica, a failover...
            outcome = self._renewal_unanswered(exc)
        return self._renewal_step(outcome, sent_at, self.fencer.renew_fraction)
