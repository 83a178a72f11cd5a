"""The asyncio front end: :class:`AsyncFencer` and :class:`AsyncLease`::

    fencer = sa_fence.AsyncFencer(redis.asyncio.Redis(socket_timeout=5), async_engine)
    async with fencer.acquire("job:1", ttl=30) as lease, Session() as session:
        lease.bind(session)
        (await session.get(Job, 1)).result = "done"
        await session.commit()        # StaleTokenError if a newer holder wrote

The API of ``Fencer``/``Lease`` and the same lifecycle, run in SQLAlchemy's greenlet bridge.
As asyncio can cancel at any ``await``, a cancelled acquire removes what it may have set in
Redis first and a release runs shielded; renewal is one task per lease, holding it weakly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.util import await_only, greenlet_spawn

from .. import telemetry as _telemetry
from ..db import prune as _prune
from ..db.dialect import check_dialect
from ..errors import FencingConfigError, LeaseBackendError
from ..orm.flush import bind_lease
from . import lifecycle as steps
from .lifecycle import BaseLease, FencerCore, released_error
from .redis_client import probe_speaks

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from ..db.prune import PruneResult

log = logging.getLogger(__name__)  # a child of "sa_fence"

T = TypeVar("T")
#: ``on_lost(lease)``: a plain callable (no async def), run once where the loss is first seen.
AsyncOnLost = Callable[["AsyncLease"], object]

RENEWAL_TASK_NAME = "sa-fence-renew"


class Acquiring(Coroutine[Any, Any, "AsyncLease"]):
    """What :meth:`AsyncFencer.acquire` returns: awaited (or run as a task), the
    :class:`AsyncLease`; entered with ``async with``, the lease, released on exit.  One way
    for both, as ``with fencer.acquire(...)`` is for :class:`~sa_fence.Fencer` (whose
    ``Lease`` is its own context manager).  A coroutine (``asyncio.create_task`` and
    ``wait_for`` take it) whose acquire starts at the first await, once."""

    __slots__ = ("_args", "_lease", "_running", "_start")

    def __init__(self, start: Callable[..., Coroutine[Any, Any, AsyncLease]], *args: Any) -> None:
        self._start: Callable[..., Coroutine[Any, Any, AsyncLease]] | None = start
        self._args = args
        self._running: Coroutine[Any, Any, AsyncLease] | None = None
        self._lease: AsyncLease | None = None

    def _coroutine(self) -> Coroutine[Any, Any, AsyncLease]:
        if self._running is None:
            start, self._start = self._start, None
            if start is None:
                raise RuntimeError("cannot reuse already awaited or closed AsyncFencer.acquire()")
            self._running = start(*self._args)
        return self._running

    def send(self, value: Any) -> Any:
        return self._coroutine().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        return self._coroutine().throw(typ, val, tb)

    def close(self) -> None:
        self._start = None  # never started: nothing to warn about once closed
        if self._running is not None:
            self._running.close()

    def __await__(self) -> Generator[Any, None, AsyncLease]:
        return self._coroutine().__await__()

    async def __aenter__(self) -> AsyncLease:
        self._lease = await self._coroutine()
        return self._lease

    async def __aexit__(self, *exc_info: object) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease.__aexit__(*exc_info)

    def __del__(self) -> None:
        if getattr(self, "_start", None) is not None:  # as a coroutine never awaited warns
            warnings.warn(
                "AsyncFencer.acquire() was never awaited nor entered, so no lease was taken: "
                "write `lease = await fencer.acquire(...)` or `async with fencer.acquire(...)`",
                RuntimeWarning,
                stacklevel=2,
            )


def _keep_quiet(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a shielded task whose caller left is not "never retrieved"


def _cancel_quietly(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` from any thread: through its loop (not at all once that is closed)."""
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:  # a thread without a loop (asyncio.to_thread), or after it closed
        here = None
    with contextlib.suppress(RuntimeError):  # its loop is closed: nothing runs it any more
        if here is not task.get_loop():
            task.get_loop().call_soon_threadsafe(task.cancel)
        elif task is not asyncio.current_task():  # (a renewal that found the loss ends itself)
            task.cancel()


async def _renew(ref: weakref.ref[AsyncLease], at: float | None) -> None:
    """One lease's renewal task, holding it weakly: a dropped lease expires in Redis."""
    while at is not None:
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if (lease := ref()) is None:
            return
        at = await greenlet_spawn(steps.renew, lease)  # (it never raises)
        del lease


class AsyncLease(BaseLease["AsyncFencer"]):
    """A granted lease for asyncio: ``name``, ``owner``, ``token``, ``ttl``.  As
    :class:`sa_fence.Lease`, with ``await lease.extend()``, ``await lease.release()`` and
    ``async with``; :meth:`bind` takes an ``AsyncSession`` (or a sync ``Session``)."""

    _log = log
    _renewal: asyncio.Task[None] | None = None
    _releasing: asyncio.Task[bool] | None = None

    async def extend(self, ttl: float | None = None) -> None:
        """As :meth:`sa_fence.Lease.extend`.  Cancelled before Redis answered, nothing changes
        locally: the lease keeps its old validity (Redis may have extended it, never the reverse).
        """
        await greenlet_spawn(steps.extend, self, ttl)

    @_telemetry.traced_release_async
    async def release(self) -> bool:
        """Give the lease back, as :meth:`sa_fence.Lease.release`, except that the lease is
        marked released only once Redis has answered: renewal stops at once, the owner-checked
        delete runs in a shielded task (cancelling the caller does not cancel it), and if Redis
        does not answer (:class:`~sa_fence.LeaseBackendError`) it stays unreleased, to retry."""
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
        """Fence ``session``'s flushes with this lease's token from now on; returns it.
        ``session`` is an ``AsyncSession`` (its sync session is bound) or a ``Session`` with the
        flush hook (:func:`sa_fence.install`).  A released lease raises
        :class:`~sa_fence.LeaseLostError`."""
        if self._state.released:
            raise released_error(self)
        bind_lease(session, self)  # type: ignore[arg-type]  # an AsyncSession is unwrapped
        return session

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.release()
        except (LeaseBackendError, FencingConfigError) as error:
            self._release_failed(error)

    async def _delete(self) -> bool:
        renewal = self._renewal
        if renewal is not None and renewal is not asyncio.current_task():
            await asyncio.wait([renewal])  # cancelled by release(): let it end first
        self._renewal = None
        return await greenlet_spawn(self._release_in_redis)

    def _start_renewal(self, at: float) -> None:
        name = f"{RENEWAL_TASK_NAME}:{self.name}"
        self._renewal = task = asyncio.create_task(_renew(weakref.ref(self), at), name=name)
        weakref.finalize(self, _cancel_quietly, task)

    def _stop_renewal(self) -> None:
        if self._renewal is not None:
            _cancel_quietly(self._renewal)


class AsyncFencer(FencerCore["aioredis.Redis | aioredis.RedisCluster", AsyncEngine, AsyncLease]):
    """Grants leases (Redis) that carry fencing tokens (PostgreSQL sequence), for asyncio.

    ``redis``: a ``redis.asyncio.Redis`` (or ``RedisCluster``) client; ``engine``: the
    ``AsyncEngine`` (``postgresql+psycopg_async://``) of the database that holds the fenced rows
    *and* the token sequence.  The rest is as for :class:`sa_fence.Fencer`, ``timeout`` (the
    failure budget) included; renewed leases are extended by one asyncio task per lease.
    """

    _log = log
    _kind = "AsyncFencer"
    _renewer_word = "renewal task"
    _lease_type = AsyncLease

    def _start(self, redis: object, engine: AsyncEngine) -> Engine:
        if not isinstance(redis, aioredis.Redis | aioredis.RedisCluster):
            raise TypeError(
                "redis must be a redis.asyncio.Redis or redis.asyncio.RedisCluster client, "
                f"got {type(redis).__module__}.{type(redis).__name__} (for a sync client "
                "use sa_fence.Fencer)"
            )
        if isinstance(engine, Engine):
            raise FencingConfigError(
                "AsyncFencer takes a sqlalchemy AsyncEngine (create_async_engine("
                "'postgresql+psycopg_async://...')); for a sync Engine use sa_fence.Fencer"
            )
        if not isinstance(engine, AsyncEngine):
            raise TypeError(f"engine must be a sqlalchemy AsyncEngine, got {type(engine).__name__}")
        check_dialect(engine.sync_engine.dialect)
        self.engine = engine
        #: Shielded clean-ups and releases still running (strong refs until done).
        self._background: set[asyncio.Task[Any]] = set()
        return self.engine.sync_engine

    async def check(self) -> None:
        """Check the token sequence and ``synchronous_commit`` now (see ``Fencer.check``)."""
        await greenlet_spawn(self._tokens.check)

    def acquire(
        self,
        name: str,
        ttl: float,
        *,
        blocking: bool = False,
        timeout: float | None = None,
        renew: bool = False,
        on_lost: AsyncOnLost | None = None,
        fail_fast: bool | None = None,
    ) -> Acquiring:
        """Take lease ``name`` for ``ttl`` seconds and draw its token, as
        :meth:`sa_fence.Fencer.acquire`: ``lease = await fencer.acquire(...)``, or
        ``async with fencer.acquire(...) as lease:``, which releases on exit (also when the
        body was cancelled).  Nothing is sent until it is awaited or entered.  Cancelled at any
        ``await``, it removes what it may have set in Redis before ``CancelledError``
        propagates, and starts no renewal."""
        return Acquiring(
            self._acquire_lease, name, ttl, blocking, timeout, renew, on_lost, fail_fast
        )

    @_telemetry.traced_acquire_async
    async def _acquire_lease(self, *args: Any) -> AsyncLease:
        return await greenlet_spawn(steps.acquire, self, *args)

    async def prune(
        self,
        *,
        older_than: float | timedelta,
        longest_lease: float | timedelta,
        dry_run: bool = False,
    ) -> PruneResult:
        """As ``Fencer.prune``: the same statements, through this fencer's engine and client."""
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
        """Wait for the owner-checked deletes this fencer runs in the background after a cancelled
        or failed acquire.  It holds no token connection of its own; granted leases keep working
        and the fencer stays usable."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task this fencer keeps alive until it is done."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_keep_quiet)
        return task

    # ------------------------------------------------------ I/O (see lease.lifecycle)

    def _next_token(self, name: str) -> Coroutine[Any, Any, int]:
        # pooled: the psycopg fast path holds a sync DBAPI connection, which an AsyncEngine lacks
        return greenlet_spawn(self._tokens.next_token, name, pooled=True)

    def _release_quietly(self, key: str, values: list[str]) -> Awaitable[None]:
        """The clean-up after a failed acquire, shielded from another cancellation."""
        return asyncio.shield(self._spawn(greenlet_spawn(super()._release_quietly, key, values)))

    @staticmethod
    def _io(awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` from the lifecycle's greenlet, raising a cancellation the
        await swallowed: redis-py's ``asyncio.wait_for`` (before Python 3.12) returns the
        result when it lands as the call completes (CPython gh-86296)."""
        task = asyncio.current_task()
        cancels = 0 if task is None else task.cancelling()
        result = await_only(awaitable)
        if task is not None and task.cancelling() > cancels:
            raise asyncio.CancelledError
        return result

    _sleep = staticmethod(lambda seconds: await_only(asyncio.sleep(seconds)))
    _script = staticmethod(lambda client, script: client.register_script(script))
    _probe = staticmethod(lambda *target: await_only(asyncio.to_thread(probe_speaks, *target)))
