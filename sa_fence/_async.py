"""The asyncio front end: :class:`AsyncFencer` and :class:`AsyncLease`.

::

    import redis.asyncio
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
    import sa_fence

    engine = create_async_engine("postgresql+psycopg_async://...")
    Session = sa_fence.install(async_sessionmaker(engine))
    fencer = sa_fence.AsyncFencer(redis.asyncio.Redis(socket_timeout=5), engine)

    async with fencer.lease("job:1", ttl=30) as lease, Session() as session:
        lease.bind(session)
        (await session.get(Job, 1)).result = "done"
        await session.commit()        # StaleTokenError if a newer holder wrote

Same API as :class:`sa_fence.Fencer` / :class:`sa_fence.Lease` (a test
compares the signatures), and the same behaviour from one source: every
validation, retry decision, validity computation, state transition and error
text comes from :mod:`sa_fence._protocol` and the shared
:class:`sa_fence._lease.BaseLease`; this module only sends, awaits and
sleeps.  The sequence check is the very same
:class:`~sa_fence._tokens.TokenSource` code, run inside SQLAlchemy's greenlet
bridge; tokens are drawn with its statement and ``synchronous_commit`` check
on an ``AsyncConnection``.  The flush hook is the sync session's own (``AsyncSession`` runs it).

What differs, because asyncio can cancel at any ``await``:

* A cancelled :meth:`AsyncFencer.acquire` removes whatever it may have set in
  Redis (owner-checked, in a shielded task that a second cancellation cannot
  interrupt) before the ``CancelledError`` propagates: no lease is left that
  we own but believe we do not.
* :meth:`AsyncLease.release` stops renewal first and marks the lease released
  only once Redis has answered; the delete runs shielded, so cancelling the
  caller does not cancel it.
* Renewal is one asyncio task per renewed lease, holding the lease weakly.
  Lease state lives on the lease object (and the decorator's contextvar),
  never in ``threading.local``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.util import greenlet_spawn

from . import _protocol as proto
from . import _prune, _telemetry
from ._dialect import check_dialect
from ._lease import (
    DEFAULT_KEY_PREFIX,
    REDIS_ERRORS,
    BaseLease,
    check_budget,
    client_socket_timeout,
    lock_timeout_ms,
    probe_speaks,
    probe_target,
    redis_error,
)
from ._tokens import DEFAULT_SEQUENCE, TokenSource, token_error
from .errors import (
    FenceError,
    FencingConfigError,
    LeaseBackendError,
    LeaseLostError,
    LeaseNotAcquiredError,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from ._prune import PruneResult

log = logging.getLogger(__name__)  # a child of "sa_fence"

T = TypeVar("T")
#: ``on_lost(lease)``: a plain callable, run once, in the task that first sees the loss.
AsyncOnLost = Callable[["AsyncLease"], object]

RENEWAL_TASK_NAME = "sa-fence-renew"


def check_async_engine(engine: object) -> AsyncEngine:
    if isinstance(engine, Engine):
        raise FencingConfigError(
            "AsyncFencer takes a sqlalchemy AsyncEngine (create_async_engine("
            "'postgresql+psycopg_async://...')); for a sync Engine use sa_fence.Fencer"
        )
    if not isinstance(engine, AsyncEngine):
        raise TypeError(f"engine must be a sqlalchemy AsyncEngine, got {type(engine).__name__}")
    check_dialect(engine.sync_engine.dialect)
    return engine


def _cancels() -> int:
    """How many cancellations of the current task are pending (see below)."""
    task = asyncio.current_task()
    return 0 if task is None else task.cancelling()


def _raise_if_cancel_swallowed(cancels: int) -> None:
    """Raise ``CancelledError`` if the current task was cancelled since it had
    ``cancels`` pending, yet the call that was awaited returned normally.

    redis-py sends each command through ``asyncio.wait_for(..., socket_timeout)``,
    and before Python 3.12 ``wait_for`` returns the inner result instead of
    raising when the cancellation arrives just as the send completes (CPython
    gh-86296).  A blocking acquire would then keep waiting for the lease up to
    its timeout (and might even take it) for a caller that has gone: on a busy
    machine, often enough to fail a test now and then.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling() > cancels:
        raise asyncio.CancelledError


def _keep_quiet(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a shielded task whose caller left is not "never retrieved"


class AsyncFencer:
    """Grants leases (Redis) that carry fencing tokens (PostgreSQL sequence), for asyncio.

    ``redis`` is a ``redis.asyncio.Redis`` (or ``RedisCluster``) client;
    ``engine`` is the ``AsyncEngine`` of the database that holds the fenced
    rows *and* the token sequence, through psycopg 3
    (``postgresql+psycopg_async://``).  Everything else is as for
    :class:`sa_fence.Fencer`, ``timeout`` (the failure budget) included;
    renewed leases are extended by one asyncio task per lease.
    """

    def __init__(
        self,
        redis: aioredis.Redis | aioredis.RedisCluster,
        engine: AsyncEngine,
        *,
        sequence: str = DEFAULT_SEQUENCE,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        renew_fraction: float = proto.DEFAULT_RENEW_FRACTION,
        timeout: float | None = None,
        telemetry: _telemetry.Telemetry | None = None,
    ) -> None:
        if not isinstance(redis, aioredis.Redis | aioredis.RedisCluster):
            raise TypeError(
                "redis must be a redis.asyncio.Redis or redis.asyncio.RedisCluster client, "
                f"got {type(redis).__module__}.{type(redis).__name__} (for a sync client "
                "use sa_fence.Fencer)"
            )
        if not isinstance(sequence, str) or not sequence:
            raise ValueError("sequence must be the (optionally schema-qualified) sequence name")
        self.redis = redis
        self.engine = check_async_engine(engine)
        self.key_prefix = proto.check_prefix(key_prefix)
        self.renew_fraction = proto.check_renew_fraction(renew_fraction)
        #: the failure budget, in seconds (see sa_fence.Fencer)
        self.timeout = check_budget(redis, timeout, "AsyncFencer")
        self._tokens = TokenSource(
            engine.sync_engine, sequence, lock_timeout_ms=lock_timeout_ms(self.timeout)
        )
        self._acquire = redis.register_script(proto.ACQUIRE_SCRIPT)
        self._confirm = redis.register_script(proto.CONFIRM_SCRIPT)
        self._extend = redis.register_script(proto.EXTEND_SCRIPT)
        self._release = redis.register_script(proto.RELEASE_SCRIPT)
        #: Shielded clean-ups and releases still running (strong refs until done).
        self._background: set[asyncio.Task[Any]] = set()
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

    async def check(self) -> None:
        """Check the token sequence and ``synchronous_commit`` now (see ``Fencer.check``)."""
        await greenlet_spawn(self._tokens.check)

    @_telemetry.traced_acquire_async
    async def acquire(
        self,
        name: str,
        ttl: float,
        *,
        blocking: bool = False,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        fail_fast: bool | None = None,
    ) -> AsyncLease:
        """Take lease ``name`` for ``ttl`` seconds and draw its token.

        As :meth:`sa_fence.Fencer.acquire`.  Cancelling it at any ``await``
        removes what it may have set in Redis before ``CancelledError``
        propagates, and starts no renewal.
        """
        key = self.key(name)
        ttl_ms = proto.ttl_to_ms(ttl)
        max_wait = proto.check_timeout(blocking, timeout, float(ttl))
        proto.check_lease_options(renew, on_lost, fail_fast)
        if not self._tokens.checked:
            try:
                await self.check()
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
        token: int | None = None
        granted = False
        try:
            started = await self._grant(name, key, owner, ttl_ms, max_wait)
            granted = True
            try:
                token = await self._next_token(name)
            except SQLAlchemyError as exc:
                raise token_error(
                    name, exc, self._tokens.lock_timeout_ms, sequence=self.sequence
                ) from None
            value = proto.confirmed_value(owner, token)
            remaining = int(
                await self._call(
                    name, "confirm", lambda: self._confirm(keys=[key], args=[owner, value])
                )
            )
        except BaseException as exc:
            if not granted and isinstance(exc, FenceError):
                # contention (nothing of ours was set), or the grant failed and
                # _grant already removed what its lost attempts may have set
                raise
            # Failed, or cancelled at an await: whatever we may have set goes
            # (owner-checked), shielded so that it finishes even if cancelled again.
            values = [owner] if token is None else [proto.confirmed_value(owner, token), owner]
            await self._shielded(self._release_quietly(key, values))
            raise
        if remaining < 0:
            # Lost before the token was confirmed: withdraw it (see Fencer.acquire).
            await greenlet_spawn(self._tokens.withdraw, name, token)
            raise LeaseLostError(proto.confirm_lost_message(name, token))
        lease = AsyncLease(
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
            lease._start_renewal(started + self.renew_fraction * ttl_ms / 1000)
        return lease

    @asynccontextmanager
    async def lease(
        self,
        name: str,
        ttl: float,
        *,
        blocking: bool = False,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        fail_fast: bool | None = None,
    ) -> AsyncIterator[AsyncLease]:
        """``async with fencer.lease(name, ttl) as lease:`` acquires, then releases on exit.

        As :meth:`sa_fence.Fencer.lease`; the release on exit also runs when
        the body was cancelled.
        """
        lease = await self.acquire(
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
            await lease._release_on_exit()

    # ------------------------------------------------------------------ I/O

    async def _next_token(self, name: str) -> int:
        """Draw and register the token in its own committed transaction (the
        statement and checks of :class:`~sa_fence._tokens.TokenSource`)."""
        tokens = self._tokens
        attempt = 1
        while True:
            try:
                async with self.engine.connect() as conn:
                    conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                    result = await conn.execute(tokens.register.grant_text(), tokens.params(name))
                    row = result.one_or_none()
                break
            except DBAPIError as exc:  # lost (a pooled connection from before a restart)?
                if not tokens.should_redraw(exc, attempt, name):
                    raise
                attempt += 1
        if row is None:
            return await greenlet_spawn(tokens.granted, None, name)
        return tokens.granted(row, name)

    async def _grant(self, name: str, key: str, owner: str, ttl_ms: int, max_wait: float) -> float:
        """Run ACQUIRE until granted; return the monotonic time validity counts from."""
        attempts = proto.AcquireAttempts(
            deadline=time.monotonic() + max_wait, failed=proto.FailureBudget(self.timeout)
        )
        waited_from = time.monotonic()
        cancels = _cancels()
        while True:
            sent_at = time.monotonic()
            try:
                reply = await self._acquire(keys=[key], args=[owner, ttl_ms])
            except REDIS_ERRORS as exc:
                failure = proto.classify_redis(exc)
                wait = attempts.on_failure(
                    failure, sent_at=sent_at, now=time.monotonic(), rand=random.random()
                )
                if wait is None:
                    # Unknown: remove what a lost ACQUIRE may have set (a failure
                    # that proves nothing was set needs no clean-up).
                    if attempts.unknown_since is not None and attempts.failed.fits_another(
                        time.monotonic()
                    ):
                        await self._shielded(self._release_quietly(key, [owner]))
                    raise await self._error(name, "acquire", exc, attempts.failed) from None
                await asyncio.sleep(wait)
                continue
            _raise_if_cancel_swallowed(cancels)
            outcome, holder_token = proto.parse_acquire_reply(reply)
            if outcome != proto.HELD:
                return attempts.sent(sent_at)
            wait = attempts.on_held(time.monotonic(), random.random())
            if wait is None:
                waited = time.monotonic() - waited_from if max_wait > 0 else None
                raise LeaseNotAcquiredError(name, holder_token, waited=waited)
            await asyncio.sleep(wait)

    async def _call(self, name: str, operation: str, do: Callable[[], Awaitable[T]]) -> T:
        """Send an idempotent script call; resend it within the failure budget while
        it fails in a way a resend may fix; then raise the error for the failure."""
        reply, _ = await self._call_counting(name, operation, do)
        return reply

    async def _call_counting(
        self, name: str, operation: str, do: Callable[[], Awaitable[T]]
    ) -> tuple[T, int]:
        """As :meth:`_call`; also how many sends failed before the one that answered."""
        budget = proto.FailureBudget(self.timeout)
        while True:
            sent_at = time.monotonic()
            try:
                return await do(), budget.failures
            except REDIS_ERRORS as exc:
                wait = budget.on_failure(
                    proto.classify_redis(exc),
                    sent_at=sent_at,
                    now=time.monotonic(),
                    rand=random.random(),
                )
                if wait is None:
                    raise await self._error(name, operation, exc, budget) from None
                await asyncio.sleep(wait)

    async def _error(
        self, name: str, operation: str, exc: BaseException, budget: proto.FailureBudget
    ) -> FenceError:
        """As :meth:`sa_fence.Fencer._error` (the probe runs in a thread)."""
        target = probe_target(self.redis)
        speaks = None
        if target is not None and proto.wants_probe(proto.classify_redis(exc)):
            wait = proto.probe_timeout(budget.remaining(time.monotonic()))
            speaks = await asyncio.to_thread(probe_speaks, target[0], target[1], wait)
        return redis_error(name, operation, exc, budget.failures, target=target, speaks=speaks)

    async def _release_quietly(self, key: str, values: list[str]) -> None:
        """Owner-checked clean-up after a failed or cancelled acquire (see
        ``Fencer._release_quietly``): one attempt per value, failures at debug level."""
        for value in values:
            try:
                await self._release(keys=[key], args=[value])
            except REDIS_ERRORS as exc:
                log.debug(
                    "could not remove lease %s after a failed acquire (%s); its TTL ends it",
                    key,
                    proto.cause_text(exc),
                )
                return

    async def prune(
        self,
        *,
        older_than: float | timedelta,
        longest_lease: float | timedelta,
        dry_run: bool = False,
    ) -> PruneResult:
        """Delete the lease register's rows of names no one holds, last granted more
        than ``older_than`` ago (see ``Fencer.prune``, which it runs the same way:
        the same statements, through this fencer's engine and Redis client)."""
        return await greenlet_spawn(
            _prune.prune,
            self.engine.sync_engine,
            _prune.async_redis_held(self.redis, self.key_prefix),
            self.sequence,
            older_than=older_than,
            longest_lease=longest_lease,
            dry_run=dry_run,
        )

    async def close(self) -> None:
        """Wait for the cleanups this fencer runs in the background to finish.

        (Owner-checked deletes after a cancelled or failed acquire.)  The
        async fencer holds no token connection of its own; leases already
        granted keep working and the fencer stays usable.
        """
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task this fencer keeps alive until it is done."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_keep_quiet)
        return task

    async def _shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to its end even if the caller is cancelled meanwhile."""
        return await asyncio.shield(self._spawn(coro))

    def _warn_if_unbounded(self) -> None:
        if self._warned_no_timeout:
            return
        if client_socket_timeout(self.redis) is None:
            self._warned_no_timeout = True
            log.warning(
                "renewed leases on a Redis client without socket_timeout: a Redis that "
                "stops answering blocks the renewal task until the OS gives up, so on_lost "
                "runs late (lease.lost and the flush check still use the local clock). "
                "Create the client with socket_timeout=<seconds well below the TTL>."
            )


def _cancel_quietly(task: asyncio.Task[Any]) -> None:
    """Cancel a renewal task whose lease was dropped (a weakref finalizer)."""
    with contextlib.suppress(RuntimeError):  # its loop is closed: nothing runs it any more
        task.cancel()


async def _renew(ref: weakref.ref[AsyncLease], at: float) -> None:
    """The renewal task of one lease: extend it when due until released, lost or dropped.

    Holds the lease only weakly between renewals, so a lease dropped without
    release stops being renewed and expires in Redis.
    """
    while True:
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        lease = ref()
        if lease is None or not lease._state.renewing:
            return
        sent_at = time.monotonic()
        try:
            try:
                reply = int(
                    await lease.fencer._extend(keys=[lease.key], args=[lease._value, lease._ttl_ms])
                )
                outcome = "extended" if reply else "not-ours"
            except REDIS_ERRORS as exc:  # timeouts, a read-only replica, a failover...
                outcome = lease._renewal_unanswered(exc)
            next_at = lease._renewal_step(outcome, sent_at, lease.fencer.renew_fraction)
        except Exception as exc:  # never stop silently
            log.exception("renewal of lease %r failed unexpectedly", lease.name)
            lease._lose(
                f"lease {lease.name!r} (token {lease.token}) could not be renewed: "
                f"{type(exc).__name__}: {exc}. Stop the work; nothing was sent."
            )
            return
        if next_at is None:
            return
        at = next_at
        del lease


class AsyncLease(BaseLease["AsyncFencer"]):
    """A granted lease for asyncio: ``name``, ``owner``, ``token``, ``ttl``.

    As :class:`sa_fence.Lease`, with ``await lease.extend()``,
    ``await lease.release()`` and ``async with``.  :meth:`bind` takes an
    ``AsyncSession`` (or a sync ``Session``).
    """

    _renewal: asyncio.Task[None] | None = None
    _releasing: asyncio.Task[bool] | None = None
    #: Run after on_lost: the decorator's "cancel the body" hooks.  A tuple,
    #: replaced rather than mutated, so it needs no per-instance set-up.
    _loss_hooks: tuple[Callable[[], object], ...] = ()

    async def extend(self, ttl: float | None = None) -> None:
        """As :meth:`sa_fence.Lease.extend`.

        Cancelled before Redis answered, nothing changes locally: the lease
        stays held with its old validity (Redis may have extended it; never
        the other way round).
        """
        ttl_ms = self._extend_ttl_ms(ttl)
        sent_at = time.monotonic()
        fencer = self.fencer
        extended = int(
            await fencer._call(
                self.name,
                "extend",
                lambda: fencer._extend(keys=[self.key], args=[self._value, ttl_ms]),
            )
        )
        self._on_extend_reply(extended, sent_at, ttl_ms)

    @_telemetry.traced_release_async
    async def release(self) -> bool:
        """Give the lease back; never deletes another owner's lease.

        As :meth:`sa_fence.Lease.release`, except that the lease is marked
        released only once Redis has answered: renewal stops at once, the
        owner-checked delete runs in a shielded task (cancelling the caller
        does not cancel it), and if Redis does not answer
        (:class:`~sa_fence.LeaseBackendError`) the lease stays unreleased so
        that a later ``release()`` can try again.
        """
        if self._state.released:
            return False
        self._stop_renewal()  # before the delete: never extend after release
        with self._lock:
            self._state.renewing = False
        releasing = self._releasing
        if releasing is None or (
            releasing.done() and (releasing.cancelled() or releasing.exception() is not None)
        ):
            releasing = self._releasing = self.fencer._spawn(self._delete())
        return await asyncio.shield(releasing)

    def bind(self, session: AsyncSession | Session) -> Any:
        """Fence ``session``'s flushes with this lease's token from now on.

        ``session`` is an ``AsyncSession`` (its sync session is bound) or a
        ``Session``; it must have the flush hook (:func:`sa_fence.install`).
        Returns the session.
        """
        from ._flush import bind_lease

        bind_lease(session, self)  # type: ignore[arg-type]  # an AsyncSession is unwrapped
        return session

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._release_on_exit()

    # ------------------------------------------------------------ internals

    async def _delete(self) -> bool:
        renewal = self._renewal
        if renewal is not None and renewal is not asyncio.current_task():
            await asyncio.wait([renewal])  # cancelled by release(): let it end first
        self._renewal = None
        first_sent = time.monotonic()
        fencer = self.fencer
        reply, failures = await fencer._call_counting(
            self.name, "release", lambda: fencer._release(keys=[self.key], args=[self._value])
        )
        with self._lock:
            self._state.released = True  # only now: Redis said the lease is not ours any more
        return self._release_outcome(bool(int(reply)), failures > 0, first_sent)

    async def _release_on_exit(self) -> None:
        try:
            await self.release()
        except (LeaseBackendError, FencingConfigError) as exc:
            log.warning(
                "could not release lease %r (token %d): %s; its TTL will end it",
                self.name,
                self.token,
                proto.cause_text(exc.cause) if exc.cause is not None else exc,
                extra=_telemetry.log_extra(self, "release_failed"),
            )

    def _start_renewal(self, at: float) -> None:
        with self._lock:
            self._state.renewing = True
        task = asyncio.ensure_future(_renew(weakref.ref(self), at))
        task.set_name(f"{RENEWAL_TASK_NAME}:{self.name}")
        self._renewal = task
        weakref.finalize(self, _cancel_quietly, task)

    def _stop_renewal(self) -> None:
        task = self._renewal
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _after_lost(self) -> None:
        for hook in self._loss_hooks:
            try:
                hook()
            except Exception:
                log.exception("loss hook of lease %r raised", self.name)
