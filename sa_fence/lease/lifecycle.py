"""The lease lifecycle (acquire, extend, renew, release, loss), written once for both front ends
over their base classes :class:`FencerCore` and :class:`BaseLease`.  Each I/O call goes through
the fencer, ``fencer._io(fencer._acquire(keys=[key], args=[...]))``: a sync ``_io`` returns the
reply of the call made, an async one awaits it (``await_only``) in the operation's greenlet, so one
``try``/``except`` serves both.  Why greenlet, and what integrations use: docs/architecture.md.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeAlias, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from .. import telemetry as _telemetry
from .._failures import FAILOVER, OUTAGE, SETUP, FailureBudget, cause_text, classify_redis
from .._lease_view import FencerView
from ..db.guard import check_name
from ..db.tokens import DEFAULT_SEQUENCE, TokenSource, token_error
from ..errors import (
    FenceError,
    FencingConfigError,
    LeaseBackendError,
    LeaseLostError,
    LeaseNotAcquiredError,
)
from ..orm.session_state import Marks
from ..telemetry import Reported
from . import protocol as proto
from .redis_client import (
    REDIS_ERRORS,
    check_budget,
    client_retries,
    has_no_socket_timeout,
    probe_target,
    redis_error,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

DEFAULT_KEY_PREFIX = "sa_fence:"

log = logging.getLogger("sa_fence.lease.sync")  # the logger the lease core's records always had

R = TypeVar("R")
E = TypeVar("E")
LeaseT = TypeVar("LeaseT", bound="BaseLease[Any]")
AnyFencer: TypeAlias = "FencerCore[Any, Any, Any]"


# ---------------------------------------------------------------- the steps


def acquire(
    f: FencerCore[Any, Any, LeaseT],
    name: str,
    ttl: float,
    blocking: bool,
    timeout: float | None,
    renew: bool,
    on_lost: Any,
    fail_fast: bool | None,
) -> LeaseT:
    """Validate, grant, draw the token, confirm it and return the front end's lease;
    after a failure or cancellation, what this owner may have set in Redis goes first."""
    key = f.key_prefix + proto.check_name(name)  # f.key(name), one call fewer
    ttl_ms = proto.ttl_to_ms(ttl)
    max_wait = proto.check_timeout(blocking, timeout, float(ttl))
    proto.check_lease_options(renew, on_lost, fail_fast)
    tokens = f._tokens
    if not tokens.checked:
        try:
            f._io(f.check())
        except SQLAlchemyError as exc:  # (raised from None: the error's .cause keeps exc)
            raise token_error(
                name, exc, tokens.lock_timeout_ms, operation="check", sequence=f.sequence
            ) from None
    if renew:
        f._warn_if_unbounded()
    owner = proto.new_owner()
    token: int | None = None
    started: float | None = None
    try:
        started = _grant(f, name, key, owner, ttl_ms, max_wait)
        try:
            token = f._io(f._next_token(name))
        except SQLAlchemyError as exc:
            raise token_error(
                name, exc, tokens.lock_timeout_ms, sequence=f.sequence, tokens=tokens
            ) from None
        value = proto.confirmed_value(owner, token)
        remaining, _ = call(f, name, "confirm", f._confirm, key, owner, value)
    except BaseException as exc:
        if started is None and isinstance(exc, FenceError):
            raise  # contention (nothing of ours set), or _grant already cleaned up
        # failed, or cancelled at an await: whatever we may have set goes
        values = [owner] if token is None else [proto.confirmed_value(owner, token), owner]
        f._io(f._release_quietly(key, values))
        if token is not None and isinstance(exc, Exception):
            # the CONFIRM failed (its outcome unknown): the token is never handed out, so the
            # register goes back, as when CONFIRM finds the lease lost (compare-and-set: a
            # newer grant stays); kept, it would refuse a live holder's commits
            tokens.withdraw(name, token)
        raise
    if int(remaining) < 0:
        # lost before the token was confirmed, so never used: the register goes back
        tokens.withdraw(name, token)  # sync code, in the async front end's greenlet
        raise LeaseLostError(proto.confirm_lost_message(name, token))
    fail_fast = renew if fail_fast is None else fail_fast
    lease = f._lease_type(
        f, name, key, owner, token, ttl, value, started, ttl_ms, fail_fast, on_lost
    )
    if renew:
        lease._state.renewing = True
        lease._start_renewal(started + f.renew_fraction * ttl_ms / 1000)
    return lease


def _grant(f: AnyFencer, name: str, key: str, owner: str, ttl_ms: int, max_wait: float) -> float:
    """Run ACQUIRE until granted; return the monotonic time validity counts from."""
    waited_from = time.monotonic()
    attempts = proto.AcquireAttempts(
        deadline=waited_from + max_wait, failed=FailureBudget(f.timeout)
    )
    while True:
        sent_at = time.monotonic()
        try:
            reply = f._io(f._acquire(keys=[key], args=[owner, ttl_ms]))
        except REDIS_ERRORS as exc:
            now = time.monotonic()
            wait = attempts.on_failure(
                classify_redis(exc), sent_at=sent_at, now=now, rand=random.random()
            )
            if wait is None:
                # Neither granted nor refused: remove what a lost ACQUIRE may have set, unless
                # nothing can have been set or the call would not end within the budget.
                if attempts.unknown_since is not None and attempts.failed.fits_another(now):
                    f._io(f._release_quietly(key, [owner]))
                raise _error(f, name, "acquire", exc, attempts.failed) from None
            f._sleep(wait)
            continue
        outcome, holder_token = proto.parse_acquire_reply(reply)
        if outcome != proto.HELD:
            return attempts.sent(sent_at)
        wait = attempts.on_held(time.monotonic(), random.random())
        if wait is None:
            waited = time.monotonic() - waited_from if max_wait > 0 else None
            raise LeaseNotAcquiredError(name, holder_token, waited=waited)
        f._sleep(wait)


def call(
    f: AnyFencer, name: str, operation: str, script: Any, key: str, *args: object
) -> tuple[Any, int]:
    """Send an idempotent script call, resent within the failure budget while a resend
    may fix its failure; (its reply, how many sends failed before)."""
    keys = [key]
    budget = None  # made at the first failure: most calls never need one
    while True:
        sent_at = time.monotonic()
        try:
            return f._io(script(keys=keys, args=args)), 0 if budget is None else budget.failures
        except REDIS_ERRORS as exc:
            budget = budget or FailureBudget(f.timeout)
            wait = budget.on_failure(
                classify_redis(exc), sent_at=sent_at, now=time.monotonic(), rand=random.random()
            )
            if wait is None:
                raise _error(f, name, operation, exc, budget) from None
            f._sleep(wait)


def _error(
    f: AnyFencer, name: str, operation: str, exc: BaseException, budget: FailureBudget
) -> FenceError:
    """The error for a Redis call that failed for good; probes the server first (within
    the budget) when nothing was sent: TLS on one side only looks like an outage."""
    target = probe_target(f.redis)
    speaks = None
    if target is not None and classify_redis(exc).kind == OUTAGE:
        wait = min(0.5, max(0.05, budget.remaining(time.monotonic())))  # 0.05 to 0.5 s
        speaks = f._probe(target[0], target[1], wait)
    took = None if budget.first_sent is None else time.monotonic() - budget.first_sent
    return redis_error(
        name,
        operation,
        exc,
        budget.failures,
        target=target,
        speaks=speaks,
        took=took,
        client_retries=client_retries(f.redis),
    )


def extend(lease: Any, ttl: float | None) -> None:
    """Owner-checked EXTEND; a lease found not ours is lost (LeaseLostError)."""
    ttl_ms = proto.ttl_to_ms(lease.ttl if ttl is None else ttl)
    state = lease._state
    if state.released or state.lost is not None:
        raise LeaseLostError(state.problem(time.monotonic(), for_write=True) or "")
    sent_at = time.monotonic()
    f = lease.fencer
    extended, _ = call(f, lease.name, "extend", f._extend, lease.key, lease._value, ttl_ms)
    if not int(extended):
        message = proto.not_ours_message(lease.name, lease.token)
        lose(lease, message)
        raise LeaseLostError(message)
    with lease._lock:
        state.on_extended(sent_at, ttl_ms)


def renew(lease: Any) -> float | None:
    """One renewal EXTEND: the next due time, or None to stop (lost or released)."""
    try:
        state = lease._state
        if not state.renewing:
            return None
        f = lease.fencer
        sent_at = time.monotonic()
        try:
            reply = f._io(f._extend(keys=[lease.key], args=[lease._value, lease._ttl_ms]))
            outcome = "extended" if int(reply) else "not-ours"
        except REDIS_ERRORS as exc:  # timeouts, a read-only replica, a failover...
            failure = classify_redis(exc)
            if failure.kind == SETUP:  # (an ACL without PEXPIRE...): no resend would pass
                lose(
                    lease,
                    f"lease {lease.name!r} (token {lease.token}) could not be renewed: "
                    f"{failure.text} Stop the work: the lease runs out at its TTL.",
                )
                return None
            log.warning(
                "renewal of lease %r failed (%s)%s; retrying until its local validity runs out",
                lease.name,
                failure.text,
                "; a failover may be under way" if failure.kind == FAILOVER else "",
                extra=_telemetry.log_extra(lease, "renewal_failed"),
            )
            outcome = "unknown"
        with lease._lock:
            if not state.renewing:
                return None  # released (or lost) meanwhile: ignore (and count) no answer
            lease._renew_failures = 0 if outcome != "unknown" else lease._renew_failures + 1
            step = proto.after_renewal(
                state,
                outcome=outcome,
                now=time.monotonic(),
                sent_at=sent_at,
                ttl_ms=lease._ttl_ms,
                fraction=f.renew_fraction,
                failures=max(0, lease._renew_failures - 1),
                rand=random.random(),
            )
        _telemetry.renewal(lease, outcome, sent_at)
        if step.lost is None:
            return step.at
        lose(lease, step.lost)
    except Exception as exc:  # never stop silently, never stop the other leases
        lease._log.exception("renewal of lease %r failed unexpectedly", lease.name)
        lose(
            lease,
            f"lease {lease.name!r} (token {lease.token}) could not be renewed: "
            f"{type(exc).__name__}: {exc}. Stop the work; nothing was sent.",
        )
    return None


def expire(lease: Any) -> Any:
    """The owner-checked RELEASE, the lease left unaware (``testing.expire``)."""
    return lease.fencer._release(keys=[lease.key], args=[lease._value])


def lose(lease: BaseLease[Any], message: str) -> None:
    """Mark ``lease`` lost, once: stop its renewal, count, log, run ``on_lost`` (on this thread)."""
    with lease._lock:
        first = lease._state.mark_lost(message)
    if not first:
        return
    try:  # (from any thread: AsyncLease.check() may run in asyncio.to_thread)
        lease._stop_renewal()
    except Exception:  # the loss is marked: telling it matters more
        lease._log.exception("could not stop the renewal of lease %r", lease.name)
    _telemetry.lost(lease)
    log.warning("%s", message, extra=_telemetry.log_extra(lease, "lost"))
    if lease._on_lost is not None:
        try:
            lease._on_lost(lease)
        except Exception:
            log.exception("on_lost callback of lease %r raised", lease.name)
    for hook in lease._loss_hooks:
        try:
            hook()
        except Exception:
            lease._log.exception("loss hook of lease %r raised", lease.name)


def add_loss_hook(lease: BaseLease[Any], hook: Callable[[], object]) -> None:
    """Run ``hook()`` after ``on_lost`` if ``lease`` is lost (until removed)."""
    lease._loss_hooks = (*lease._loss_hooks, hook)


def remove_loss_hook(lease: BaseLease[Any], hook: Callable[[], object]) -> None:
    lease._loss_hooks = tuple(h for h in lease._loss_hooks if h is not hook)


# ------------------------------------------------------------ the base classes


class FencerCore(Generic[R, E, LeaseT]):
    """What both fencers hold and do without I/O, generic in their client, engine and lease."""

    _log: ClassVar[logging.Logger] = log
    _kind: ClassVar[str]  # the class name in errors
    _renewer_word: ClassVar[str]  # what renews, in a warning
    _lease_type: type[LeaseT]
    _script: Callable[[Any, str], Any]  # (client, Lua text) -> callable(keys=, args=)

    def __init__(
        self,
        redis: R,
        engine: E,
        *,
        sequence: str = DEFAULT_SEQUENCE,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        renew_fraction: float = proto.DEFAULT_RENEW_FRACTION,
        timeout: float | None = None,
        telemetry: _telemetry.Telemetry | None = None,
    ) -> None:
        sync_engine = self._start(redis, engine)
        check_name("sequence", sequence)  # a name, optionally schema-qualified
        if not (telemetry is None or isinstance(telemetry, _telemetry.Telemetry)):
            raise TypeError(f"telemetry must be a sa_fence.telemetry.Telemetry, got {telemetry!r}")
        self.redis = redis
        self.key_prefix = proto.check_prefix(key_prefix)
        self.renew_fraction = proto.check_renew_fraction(renew_fraction)
        self.timeout = check_budget(redis, timeout, self._kind)  # the failure budget, in seconds
        # the register's lock wait is bounded by the same budget
        self._tokens = TokenSource(
            sync_engine, sequence, lock_timeout_ms=max(1, math.ceil(self.timeout * 1000))
        )
        script = self._script
        self._acquire = script(redis, proto.ACQUIRE_SCRIPT)
        self._confirm = script(redis, proto.CONFIRM_SCRIPT)
        self._extend = script(redis, proto.EXTEND_SCRIPT)
        self._release = script(redis, proto.RELEASE_SCRIPT)
        self._warned_no_timeout = False
        self._telemetry = telemetry  # where metrics and spans go (None: the global providers)

    # The front end's set-up (check the client and engine; return the token Engine), and its
    # I/O: each returns the reply or (asyncio) an awaitable of it, which _io turns into the reply.
    _start: Callable[[object, E], Engine]
    check: Callable[[], Awaitable[None] | None]
    _io: Callable[[Any], Any]
    _next_token: Callable[[str], Any]
    _sleep: Callable[[float], Any]
    _probe: Callable[[str, int, float], Any]

    def _release_quietly(self, key: str, values: list[str]) -> Any:
        """Owner-checked clean-up after a failed or cancelled acquire, one attempt per value."""
        for value in values:
            try:
                self._io(self._release(keys=[key], args=[value]))
            except REDIS_ERRORS as exc:
                self._log.debug(
                    "could not remove lease %s after a failed acquire (%s); its TTL ends it",
                    key,
                    cause_text(exc),
                )
                return

    @property
    def sequence(self) -> str:
        return self._tokens.sequence

    @property  # package-internal, so no docstring (nor an API entry): for the flush hook
    def token_source(self) -> TokenSource:
        return self._tokens

    def key(self, name: str) -> str:
        """The Redis key that holds lease ``name``."""
        return self.key_prefix + proto.check_name(name)

    def _warn_if_unbounded(self) -> None:
        if not self._warned_no_timeout and has_no_socket_timeout(self.redis):
            self._warned_no_timeout = True
            self._log.warning(
                "renewed leases on a Redis client without socket_timeout: a Redis that "
                "stops answering blocks the %s until the OS gives up, so on_lost "
                "runs late (lease.lost and the flush check still use the local clock). "
                "Create the client with socket_timeout=<seconds well below the TTL>.",
                self._renewer_word,
            )


FencerT = TypeVar("FencerT", bound=FencerView)

#: Fencers that already logged "a lease was released without being bound".
_warned_unbound: weakref.WeakSet[Any] = weakref.WeakSet()


def _warn_never_bound(lease: BaseLease[Any]) -> None:
    """Once per Fencer: release is the one cheap place that sees a lease fenced nothing."""
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


#: How many forks this process is from the one that imported sa-fence.  A lease keeps the count
#: it was granted at (``_forks``): a forked child tells the leases it inherited by it, which
#: are its parent's to release.
forks = 0


def _count_fork() -> None:
    global forks
    forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


def released_error(lease: BaseLease[Any]) -> LeaseLostError:
    """What binding a released lease raises: it holds nothing any more, so its fenced writes
    would all be refused (checked by the front ends' ``bind``, on the lease's own state)."""
    return LeaseLostError(
        f"lease {lease.name!r} (token {lease.token}) was released, so it no longer fences "
        "anything; acquire a new lease and bind that. The session is not bound."
    )


class BaseLease(Marks, Reported, Generic[FencerT]):
    """What a holder knows about a granted lease, without I/O: its state, its validity
    on this process's monotonic clock, and the "is it still usable" checks."""

    _log = log  # the front end's logger
    #: Run after on_lost: ``@fenced``'s "cancel the body" hooks (add_loss_hook); a tuple,
    #: replaced rather than mutated, so it needs no per-instance set-up.
    _loss_hooks: tuple[Callable[[], object], ...] = ()

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
        ttl_ms: int,
        fail_fast: bool,
        on_lost: Callable[[Any], object] | None,
    ) -> None:
        self.fencer = fencer
        self.name = name
        self.key = key
        self.owner = owner
        self.token = token
        self.ttl = ttl
        self._value = value
        self.acquired_at = acquired_at
        self._ttl_ms = ttl_ms
        self._lock = threading.Lock()
        valid_until = proto.valid_until(acquired_at, ttl_ms)
        self._state = proto.LeaseState(name, token, valid_until, fail_fast)
        self._on_lost = on_lost
        self._renew_failures = 0
        self._forks = forks

    def __repr__(self) -> str:
        state = "released" if self.released else "lost" if self.lost else "held"
        return f"<{type(self).__name__} {self.name!r} token={self.token} ttl={self.ttl} {state}>"

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._state.released

    @property
    def lost(self) -> bool:
        """True once the lease is known to be gone, for good: renewal or :meth:`extend` found
        another owner or no lease, or a renewed lease's local validity ran out unrenewed."""
        self._notice_overdue()
        return self._state.lost is not None

    def remaining(self) -> float:
        """Seconds of local validity left (0.0 once passed), on the monotonic clock: the lease
        is surely ours in Redis until then (unless the key was deleted), maybe not after."""
        return max(0.0, self._state.valid_until - time.monotonic())

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost (what :class:`~sa_fence.LeaseLostError` says), or None
        exactly while :attr:`lost` is False (an overdue renewal counts for both)."""
        self._notice_overdue()
        return self._state.lost

    def check(self, *, for_write: bool = False) -> None:
        """Raise :class:`~sa_fence.LeaseLostError` unless the lease is still usable: not released,
        not lost, within its local validity.  No round trip to Redis: call it between steps of long
        work.  ``for_write=True`` is the check a bound session makes before each fenced write: local
        validity then counts only with ``fail_fast`` (otherwise the fence decides), and a renewed
        lease whose renewal is overdue counts as lost."""
        state = self._state  # the hot path (every fenced flush and statement): no calls
        if not (state.released or state.lost is not None) and (
            (for_write and not (state.renewing or state.fail_fast))
            or time.monotonic() < state.valid_until
        ):
            return
        self._notice_overdue()
        problem = state.problem(time.monotonic(), for_write=for_write)
        if problem is not None:
            raise LeaseLostError(problem)

    def _release_in_redis(self) -> bool:
        """Owner-checked RELEASE (renewal already stopped); True when it deleted our live lease."""
        f: Any = self.fencer
        first_sent = time.monotonic()
        reply, failures = call(f, self.name, "release", f._release, self.key, self._value)
        with self._lock:
            self._state.released = True
        if not self._bound:
            _warn_never_bound(self)
        deleted = proto.release_deleted(
            self._state,
            deleted=bool(int(reply)),
            resent=failures > 0,
            first_sent=first_sent,
            now=time.monotonic(),
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

    # The front end's renewer: renew from this monotonic time on (state.renewing), and stop.
    _start_renewal: Callable[[float], None]
    _stop_renewal: Callable[[], None]

    def _release_failed(self, exc: LeaseBackendError | FencingConfigError) -> None:
        """The release on leaving a ``with`` block failed: the TTL ends the lease."""
        self._log.warning(
            "could not release lease %r (token %d): %s; its TTL will end it",
            self.name,
            self.token,
            cause_text(exc.cause) if exc.cause is not None else exc,
            extra=_telemetry.log_extra(self, "release_failed"),
        )

    def _notice_overdue(self) -> None:
        if self._state.overdue(time.monotonic()):
            lose(self, proto.renewal_timed_out_message(self.name, self.token))
