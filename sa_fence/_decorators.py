"""Repository-layer decorators: run a method under a fenced lease.

::

    class JobRepository:
        def __init__(self, session: Session, fencer: sa_fence.Fencer) -> None:
            self.session = session          # found by attribute name "session"
            self.fencer = fencer            # found by attribute name "fencer"

        @sa_fence.fenced("job:{job_id}", ttl=30, renew=True)
        def finish(self, job_id: int, result: str) -> None:
            self.session.get(Job, job_id).result = result   # committed on return

    # A task or a script with no session of its own: give the factory.
    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=Session)
    def finish_job(job_id: int, result: str) -> None:
        sa_fence.current_session().get(Job, job_id).result = result

Each call formats the lease name from the call's arguments, acquires the
lease (contention: raise, skip or wait), opens a session if it was given a
factory, binds the lease to the session, runs the body, commits (or rolls
back if the body raised or the lease was lost), restores the session's
previous binding, closes the session it opened and releases the lease.  A
fenced call nested inside another on the same name and Fencer, in the same
call stack (thread or asyncio task), reuses the held lease instead of
waiting for itself.  :func:`fenced_methods` does the same for every public
method of a class.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import heapq
import inspect
import itertools
import logging
import os
import string
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Protocol, TypeAlias, TypeVar, overload

from sqlalchemy.orm import Session, scoped_session, sessionmaker

from . import _protocol as proto
from . import _telemetry
from ._lease import BaseLease, Fencer, OnLost
from .errors import LeaseLostError, LeaseNotAcquiredError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker

    from ._async import AsyncFencer, AsyncLease
    from ._flush import SessionState

log = logging.getLogger(__name__)  # a child of "sa_fence"

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=type)

#: What ``session=`` takes: a session, a scoped session (its current session
#: is used), a factory (a session is opened and closed per call), or the name
#: of a parameter / attribute of the first argument holding one of these.
SessionSource: TypeAlias = (
    "Session | AsyncSession | scoped_session[Any] | async_scoped_session[Any] "
    "| sessionmaker[Any] | async_sessionmaker[Any] | Callable[[], Session | AsyncSession] | str"
)


class _SkippingDecorator(Protocol):
    """What ``fenced(..., on_busy="skip")`` returns: ``SKIPPED`` joins the result type.

    For a coroutine function the *awaited* result may be ``SKIPPED``.
    """

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, R]], /
    ) -> Callable[P, Coroutine[Any, Any, R | Skipped]]: ...
    @overload
    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R | Skipped]: ...


OnBusy = Literal["raise", "skip", "wait"]
_ON_BUSY = ("raise", "skip", "wait")
_MARK = "__sa_fence_fenced__"


class Skipped(enum.StrEnum):
    """The type of :data:`SKIPPED`.

    A ``str`` enum, so that a skipped call's result serializes as it is: JSON
    (Celery's default result serializer, a web framework's response) carries
    it as the string ``"sa_fence.SKIPPED"``, and pickle as the enum member.
    After a JSON round trip the value is that plain string, which still
    compares equal: test it with ``result == sa_fence.SKIPPED`` (``is`` holds
    only in the process that returned it).
    """

    SKIPPED = "sa_fence.SKIPPED"

    def __repr__(self) -> str:
        return "sa_fence.SKIPPED"


#: Returned instead of running the body when ``on_busy="skip"`` and the lease is held.
SKIPPED = Skipped.SKIPPED


@dataclass(frozen=True, slots=True)
class _Frame:
    """One running fenced call: what a nested call on the same name may reuse."""

    fencer: object
    name: str
    lease: Any  # a Lease, or an AsyncLease in an async def
    session: Any  # the Session or AsyncSession the call runs on


#: The fenced calls running in this context, outermost first (a contextvar:
#: each thread and each asyncio task sees its own call stack).
_frames: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar(
    "sa_fence_fenced_calls", default=()
)


def current_lease() -> Any:
    """The lease of the innermost :func:`fenced` call running in this context.

    A :class:`~sa_fence.Lease`, or an :class:`~sa_fence.AsyncLease` inside an
    ``async def`` fenced call (a contextvar: each asyncio task sees its own).

    For the body's own use: ``current_lease().token`` as part of an
    idempotency key for external side effects, or ``current_lease().check()``
    between steps of long work.  Raises ``LookupError`` outside a fenced call.
    """
    frames = _frames.get()
    if not frames:
        raise LookupError("sa_fence.current_lease() was called outside a @sa_fence.fenced call")
    return frames[-1].lease


def current_session() -> Any:
    """The session of the innermost :func:`fenced` call running in this context.

    The ``Session`` (or ``AsyncSession``) the call opened from the factory it
    was given (``session=Session``), or the one it found: bound to the call's
    lease and committed when the call returns.  Raises ``LookupError``
    outside a fenced call.
    """
    frames = _frames.get()
    if not frames:
        raise LookupError("sa_fence.current_session() was called outside a @sa_fence.fenced call")
    return frames[-1].session


def _held(fencer: object, name: str) -> _Frame | None:
    """The innermost running call holding lease ``name`` of ``fencer`` (not released)."""
    for frame in reversed(_frames.get()):
        if frame.fencer is fencer and frame.name == name and not frame.lease.released:
            return frame
    return None


def _template_fields(template: str) -> list[str]:
    roots = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(
                f"lease name template {template!r} has a positional field {{{field}}}: "
                "name the parameter instead, e.g. 'job:{job_id}'"
            )
        roots.append(root)
    return roots


def _check_template(template: object) -> list[str]:
    if not isinstance(template, str):
        raise TypeError(
            f"the lease name template must be a str such as 'job:{{job_id}}', got {template!r}"
        )
    if not template:
        raise ValueError("the lease name template is empty; name the resource, e.g. 'job:{job_id}'")
    try:
        return _template_fields(template)
    except ValueError as exc:
        if "positional field" in str(exc):
            raise
        raise ValueError(
            f"lease name template {template!r} is not a valid format string ({exc}); "
            "use str.format fields such as 'job:{job_id}' and double braces for literal ones"
        ) from None


def _check_fields(template: str, fields: list[str], fn: Callable[..., Any]) -> inspect.Signature:
    sig = inspect.signature(fn)
    params = sig.parameters
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [f for f in fields if f not in params and not has_var_kw]
    if unknown:
        raise ValueError(
            f"lease name template {template!r} uses {', '.join(map(repr, unknown))}, which "
            f"{fn.__qualname__}() has no parameter for (parameters: "
            f"{', '.join(params) or 'none'}); name one of its parameters"
        )
    return sig


def _async_kinds() -> tuple[type, type, type, type] | None:
    """(AsyncFencer, AsyncSession, async_sessionmaker, async_scoped_session) if the
    asyncio front end is loaded, else None.

    Not imported here: an AsyncFencer or AsyncSession can only exist once its
    module is loaded, and sync users need not load SQLAlchemy's asyncio.
    """
    if "sa_fence._async" not in sys.modules:
        return None
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker

    from ._async import AsyncFencer

    return AsyncFencer, AsyncSession, async_sessionmaker, async_scoped_session


# How a session= value is used at each call.
_SESSION = "session"  # this very session
_SCOPED = "scoped"  # a scoped_session: its current session (not closed by us)
_FACTORY = "factory"  # a session factory: a new session per call, closed after it


def _session_kind(value: object, *, any_callable: bool) -> tuple[str, bool | None] | None:
    """(how it is used, is it asyncio's: True/False, None when unknown) or None."""
    if isinstance(value, Session):
        return _SESSION, False
    if isinstance(value, scoped_session):
        return _SCOPED, False
    if isinstance(value, sessionmaker) or (isinstance(value, type) and issubclass(value, Session)):
        return _FACTORY, False
    kinds = _async_kinds()
    if kinds is not None:
        _, async_session, async_maker, async_scoped = kinds
        if isinstance(value, async_session):
            return _SESSION, True
        if isinstance(value, async_scoped):
            return _SCOPED, True
        if isinstance(value, async_maker) or (
            isinstance(value, type) and issubclass(value, async_session)
        ):
            return _FACTORY, True
    if any_callable and callable(value):
        return _FACTORY, None
    return None


def _check_fencer_locator(value: object) -> None:
    if (isinstance(value, str) and value.isidentifier()) or isinstance(value, Fencer):
        return
    kinds = _async_kinds()
    if kinds is not None and isinstance(value, kinds[0]):
        return
    raise TypeError(
        "fencer must be a Fencer or the name of a parameter / attribute of the first "
        f"argument holding one (AsyncFencer for an async def), got {value!r}"
    )


def _check_session_locator(value: object) -> None:
    if isinstance(value, str) and value.isidentifier():
        return
    if _session_kind(value, any_callable=True) is not None:
        return
    raise TypeError(
        "session must be a Session, a scoped_session, a session factory (a sessionmaker, "
        "or any callable returning a Session; a session is opened and closed per call), "
        "or the name of a parameter / attribute of the first argument holding one "
        f"(their asyncio kinds for an async def), got {value!r}"
    )


def _check_sides(fn: Callable[..., Any], is_async: bool, fencer: object, session: object) -> None:
    """An async def needs the asyncio kinds given explicitly, a def the sync ones."""
    kind = "an async def" if is_async else "a plain def"
    if not isinstance(fencer, str) and isinstance(fencer, Fencer) == is_async:
        want = "AsyncFencer" if is_async else "Fencer"
        raise TypeError(
            f"@fenced on {kind} ({fn.__qualname__}) needs fencer=<a {want}>, got "
            f"{type(fencer).__name__}"
        )
    if isinstance(session, str):
        return
    found = _session_kind(session, any_callable=True)
    if found is not None and found[1] is not None and found[1] != is_async:
        want = (
            "an AsyncSession, async_scoped_session or async_sessionmaker"
            if is_async
            else "a Session, scoped_session or sessionmaker"
        )
        raise TypeError(
            f"@fenced on {kind} ({fn.__qualname__}) needs session=<{want}>, got "
            f"{type(session).__name__}"
        )


def _first_or_parameter(what: str, locator: str, bound: inspect.BoundArguments) -> Any:
    if locator in bound.arguments:
        return bound.arguments[locator]
    args = list(bound.arguments.values())
    first = args[0] if args else None
    if first is None or not hasattr(first, locator):
        raise TypeError(
            f"@fenced could not find the {what}: the call has no parameter "
            f"{locator!r} and its first argument ({type(first).__name__}) has no "
            f"attribute {locator!r}. Pass {what}=<name of the parameter or attribute>, "
            f"or {what}=<the object> to fenced()"
        )
    return getattr(first, locator)


def _locate_fencer(locator: object, kind: type, bound: inspect.BoundArguments) -> Any:
    if not isinstance(locator, str):
        return locator
    found = _first_or_parameter("fencer", locator, bound)
    if not isinstance(found, kind):
        raise TypeError(
            f"@fenced found fencer {locator!r} but it is a {type(found).__name__}, "
            f"not a {kind.__name__}"
        )
    return found


def _locate_session(
    locator: object, bound: inspect.BoundArguments, is_async: bool
) -> tuple[str, Any]:
    """(how to use it, the source): no I/O, so it fails before anything is written."""
    if isinstance(locator, str):
        source = _first_or_parameter("session", locator, bound)
        found = _session_kind(source, any_callable=False)
        if found is None or found[1] != is_async:
            want = "an AsyncSession" if is_async else "a Session"
            raise TypeError(
                f"@fenced found session {locator!r} but it is a {type(source).__name__}, "
                f"not {want} (or its scoped_session or sessionmaker)"
            )
        return found[0], source
    found = _session_kind(locator, any_callable=True)
    assert found is not None  # checked at decoration
    return found[0], locator


def _open(how: str, source: Any, is_async: bool) -> Any:
    """The session to run on: the session itself, a scoped session's current one, or a new one."""
    if how == _SESSION:
        return source
    session = source()
    kinds = _async_kinds()
    want = (kinds[1] if kinds is not None else None) if is_async else Session
    if want is None or not isinstance(session, want):
        close = getattr(session, "close", None)
        if how == _FACTORY and callable(close) and not inspect.iscoroutinefunction(close):
            close()
        raise TypeError(
            f"@fenced's session {'factory' if how == _FACTORY else 'registry'} {source!r} "
            f"returned a {type(session).__name__}, not "
            f"{'an AsyncSession' if is_async else 'a Session'}"
        )
    return session


# ------------------------------------------------------------------ max_hold


def _max_hold_message(lease: BaseLease[Any], max_hold: float) -> str:
    return (
        f"lease {lease.name!r} (token {lease.token}) reached its max_hold of {max_hold:g} s, "
        "the cap on its renewal: it is no longer renewed and counts as lost. Stop the "
        "work; its writes will be refused."
    )


class _HoldLimits:
    """Marks leases lost when they reach their ``max_hold``: one daemon thread.

    A heap of deadlines, as the Fencer's renewer keeps: any number of capped
    leases cost one thread, which starts with the first and exits as soon as
    none is pending.  Each fenced call cancels its entry when it ends.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, BaseLease[Any], str]] = []
        self._pending: set[int] = set()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, at: float, lease: BaseLease[Any], message: str) -> int:
        with self._cond:
            entry = next(self._seq)
            heapq.heappush(self._heap, (at, entry, lease, message))
            self._pending.add(entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="sa-fence-max-hold", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return entry

    def cancel(self, entry: int) -> None:
        with self._cond:
            self._pending.discard(entry)
            self._cond.notify()

    def _next_due(self) -> tuple[BaseLease[Any], str] | None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._pending:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._thread = None
                    return None
                at, entry, lease, message = self._heap[0]
                now = time.monotonic()
                if at > now:
                    self._cond.wait(at - now)
                    continue
                heapq.heappop(self._heap)
                self._pending.discard(entry)
                return lease, message

    def _run(self) -> None:
        while (due := self._next_due()) is not None:
            lease, message = due
            try:
                lease._lose(message)
            except Exception:  # never stop the others
                log.exception("marking lease %r lost at its max_hold failed", lease.name)
            del lease, due


_hold_limits = _HoldLimits()
# A forked child (Celery's prefork pool) starts with no thread and no entries.
os.register_at_fork(after_in_child=_hold_limits._reset)


# ----------------------------------------------------------------- decorator


@overload
def fenced(
    name: str,
    *,
    ttl: float,
    on_busy: Literal["skip"],
    timeout: float | None = ...,
    renew: bool = ...,
    max_hold: float | None = ...,
    on_lost: OnLost | None = ...,
    fail_fast: bool | None = ...,
    fencer: Fencer | AsyncFencer | str = ...,
    session: SessionSource = ...,
    cancel_on_lost: bool | None = ...,
) -> _SkippingDecorator: ...
@overload
def fenced(
    name: str,
    *,
    ttl: float,
    on_busy: Literal["raise", "wait"] = ...,
    timeout: float | None = ...,
    renew: bool = ...,
    max_hold: float | None = ...,
    on_lost: OnLost | None = ...,
    fail_fast: bool | None = ...,
    fencer: Fencer | AsyncFencer | str = ...,
    session: SessionSource = ...,
    cancel_on_lost: bool | None = ...,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
def fenced(
    name: str,
    *,
    ttl: float,
    on_busy: OnBusy = "raise",
    timeout: float | None = None,
    renew: bool = False,
    max_hold: float | None = None,
    on_lost: OnLost | None = None,
    fail_fast: bool | None = None,
    fencer: Fencer | AsyncFencer | str = "fencer",
    session: SessionSource = "session",
    cancel_on_lost: bool | None = None,
) -> Callable[[Callable[P, R]], Callable[P, Any]]:
    """Run the decorated function under lease ``name`` with its session fenced.

    ``name`` is a ``str.format`` template filled from the call's arguments by
    parameter name (``"job:{job_id}"``, ``"sheet:{sheet.id}"``).

    ``fencer``: a :class:`~sa_fence.Fencer`, or (the default) a name looked up
    first among the call's parameters, then as an attribute of the first
    argument (``self.fencer`` for a repository method).

    ``session``: where the unit of work runs.  A ``Session`` (used as it is);
    a ``scoped_session`` (its current session); a **session factory** (a
    ``sessionmaker`` or any callable returning a ``Session``: a session is
    opened for each call and closed after it, which suits Celery tasks and
    scripts, whose arguments cannot carry a session); or (the default) a
    name looked up like ``fencer``, whose value may be any of these.  Inside
    the body, :func:`current_session` returns the session.

    ``on_busy`` when another owner holds the lease: ``"raise"``
    :class:`~sa_fence.LeaseNotAcquiredError`; ``"skip"`` the body and return
    :data:`~sa_fence.SKIPPED`; ``"wait"`` up to ``timeout`` seconds (default:
    ``ttl``), then raise.  ``ttl``, ``renew``, ``on_lost`` and ``fail_fast``
    are passed to :meth:`Fencer.acquire`.

    ``max_hold`` (with ``renew=True``): the longest time, in seconds from
    the grant, that the lease is renewed.  When it is reached, renewal stops
    and the lease counts as lost: ``on_lost`` runs, bound sessions refuse to
    flush (:class:`~sa_fence.LeaseLostError`), an ``async def`` body is
    cancelled (``cancel_on_lost``), and the call rolls back and raises
    ``LeaseLostError`` instead of committing.  A hung worker thus gives the
    name back after ``max_hold`` instead of renewing it forever.

    On return the session is committed, unless the lease was lost (or
    released) meanwhile: then it is rolled back and ``LeaseLostError``
    raised.  If the body raises, the session is rolled back.  Either way the
    session's previous binding is restored, a session the call opened is
    closed, and the lease released.  Bad arguments raise
    ``TypeError``/``ValueError`` here, at decoration time.

    **Nested calls.**  A fenced call made while a fenced call on the same
    lease name and Fencer is running in the same thread or asyncio task
    (a repository method calling another) reuses that call's lease instead
    of acquiring it again (which would wait for itself).  On the same
    session it joins the outer call's unit of work: it neither commits nor
    rolls back, and the outer call does.  On another session it commits or
    rolls back that session as usual.  Only the outermost call releases the
    lease; the nested call's own ``ttl``, ``renew`` and ``on_busy`` do not
    apply.  If the held lease was lost, the nested call raises
    :class:`~sa_fence.LeaseLostError` before its body runs.

    On an ``async def`` the same options apply, with an
    :class:`~sa_fence.AsyncFencer` and an ``AsyncSession`` (or
    ``async_sessionmaker``, ``async_scoped_session``); the call is awaited,
    commits with ``await session.commit()``, and, with ``cancel_on_lost``
    (default True; async only), a lease found lost while the body runs
    cancels the body, rolls back and raises :class:`~sa_fence.LeaseLostError`.

    The wrapper keeps the function's signature (``__signature__``, also seen
    by ``inspect.getfullargspec``), so frameworks that check arguments before
    calling (Celery's ``apply_async``, FastAPI) see the real parameters.
    """
    fields = _check_template(name)
    ttl_ms = proto.ttl_to_ms(ttl)
    if on_busy not in _ON_BUSY:
        raise ValueError(f"on_busy must be one of {', '.join(_ON_BUSY)}, got {on_busy!r}")
    if on_busy != "wait" and timeout is not None:
        raise ValueError(
            f"timeout={timeout!r} applies only with on_busy='wait': pass on_busy='wait' "
            "to wait for a busy lease, or drop timeout"
        )
    proto.check_timeout(on_busy == "wait", timeout, ttl_ms / 1000)
    if not isinstance(renew, bool):
        raise TypeError(f"renew must be True or False, got {renew!r}")
    if max_hold is not None:
        proto.ttl_to_ms(max_hold, "max_hold")
        if not renew:
            raise ValueError(
                f"max_hold={max_hold!r} caps renewal, so it needs renew=True (without "
                "renewal the lease ends after its ttl anyway)"
            )
        if max_hold < ttl:
            raise ValueError(
                f"max_hold={max_hold!r} is shorter than ttl={ttl!r}: the lease would count "
                "as lost before it was ever renewed; use a shorter ttl or a longer max_hold"
            )
    if on_lost is not None and not callable(on_lost):
        raise TypeError(f"on_lost must be a callable taking the lease, got {on_lost!r}")
    if fail_fast is not None and not isinstance(fail_fast, bool):
        raise TypeError(f"fail_fast must be True, False or None, got {fail_fast!r}")
    _check_fencer_locator(fencer)
    _check_session_locator(session)
    if cancel_on_lost is not None and not isinstance(cancel_on_lost, bool):
        raise TypeError(f"cancel_on_lost must be True, False or None, got {cancel_on_lost!r}")

    acquire_options: dict[str, Any] = {
        "blocking": on_busy == "wait",
        "timeout": timeout,
        "renew": renew,
        "fail_fast": fail_fast,
    }

    def decorate(fn: Callable[P, R]) -> Callable[P, Any]:
        if not callable(fn):
            raise TypeError(f"@fenced decorates a function or method, got {fn!r}")
        is_async = inspect.iscoroutinefunction(fn)
        if cancel_on_lost is not None and not is_async:
            raise ValueError(
                f"cancel_on_lost applies only to an async def (a thread cannot be cancelled); "
                f"{fn.__qualname__} is a plain def: drop cancel_on_lost and call "
                "current_lease().check() between steps instead"
            )
        _check_sides(fn, is_async, fencer, session)
        sig = _check_fields(name, fields, fn)

        def lease_name_of(args: Any, kwargs: Any) -> tuple[str, inspect.BoundArguments]:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            try:
                lease_name = name.format_map(bound.arguments)
            except (KeyError, AttributeError, IndexError, TypeError, ValueError) as exc:
                raise ValueError(
                    f"could not fill lease name template {name!r} from the arguments of "
                    f"{fn.__qualname__}(): {type(exc).__name__}: {exc}"
                ) from None
            return proto.check_name(lease_name), bound

        def skipped(lease_name: str) -> Skipped:
            """Contention: SKIPPED under on_busy="skip", else re-raise."""
            if on_busy != "skip":
                raise  # the LeaseNotAcquiredError being handled
            log.info("lease %r is busy; skipped %s()", lease_name, fn.__qualname__)
            return SKIPPED

        if is_async:
            from ._async import AsyncFencer

            on_lost_any: Any = on_lost  # called with the AsyncLease
            cancel = cancel_on_lost is not False

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                lease_name, bound = lease_name_of(args, kwargs)
                the_fencer: AsyncFencer = _locate_fencer(fencer, AsyncFencer, bound)
                how, source = _locate_session(session, bound, is_async=True)
                held = _held(the_fencer, lease_name)
                if held is not None:
                    return await _nested_async(fn, args, kwargs, held, how, source, cancel)
                try:
                    with _telemetry.naming(name):  # metrics name the template, not the name
                        lease = await the_fencer.acquire(
                            lease_name, ttl, on_lost=on_lost_any, **acquire_options
                        )
                except LeaseNotAcquiredError:
                    return skipped(lease_name)
                limit = None
                if max_hold is not None:
                    limit = asyncio.get_running_loop().call_later(
                        max(0.0, lease.acquired_at + max_hold - time.monotonic()),
                        lease._lose,
                        _max_hold_message(lease, max_hold),
                    )
                try:
                    the_session = _open(how, source, is_async=True)
                    try:
                        frame = _Frame(the_fencer, lease_name, lease, the_session)
                        return await _run_fenced_async(fn, args, kwargs, frame, cancel)
                    finally:
                        if how == _FACTORY:
                            await the_session.close()
                finally:
                    if limit is not None:
                        limit.cancel()
                    await lease._release_on_exit()

            setattr(async_wrapper, _MARK, True)
            setattr(async_wrapper, "__signature__", sig)  # noqa: B010  # getfullargspec reads it
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            lease_name, bound = lease_name_of(args, kwargs)
            the_fencer: Fencer = _locate_fencer(fencer, Fencer, bound)
            how, source = _locate_session(session, bound, is_async=False)
            held = _held(the_fencer, lease_name)
            if held is not None:
                return _nested(fn, args, kwargs, held, how, source)
            try:
                with _telemetry.naming(name):  # metrics name the template, not the name
                    lease = the_fencer.acquire(lease_name, ttl, on_lost=on_lost, **acquire_options)
            except LeaseNotAcquiredError:
                return skipped(lease_name)
            limit = None
            if max_hold is not None:
                limit = _hold_limits.add(
                    lease.acquired_at + max_hold, lease, _max_hold_message(lease, max_hold)
                )
            try:
                the_session = _open(how, source, is_async=False)
                try:
                    frame = _Frame(the_fencer, lease_name, lease, the_session)
                    return _run_fenced(fn, args, kwargs, frame)
                finally:
                    if how == _FACTORY:
                        the_session.close()
            finally:
                if limit is not None:
                    _hold_limits.cancel(limit)
                lease._release_on_exit()

        setattr(wrapper, _MARK, True)
        setattr(wrapper, "__signature__", sig)  # noqa: B010  # getfullargspec reads it
        return wrapper

    return decorate


def _session_state(session: Any) -> SessionState:
    from ._flush import state_for

    sync_session = getattr(session, "sync_session", session)  # an AsyncSession's own
    return state_for(sync_session)


def _run_fenced(
    fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any], frame: _Frame
) -> R:
    """Bind, run, commit (unless the lease was lost) or roll back, restore the binding."""
    lease, session = frame.lease, frame.session
    state = _session_state(session)
    previous = state.lease
    reset = _frames.set((*_frames.get(), frame))
    try:
        lease.bind(session)
        try:
            result = fn(*args, **kwargs)
            # Lost (renewal, max_hold) or released meanwhile: commit nothing.
            lease._check_for_write()
            session.commit()
        except BaseException:
            session.rollback()
            raise
        return result
    finally:
        state.lease = previous
        _frames.reset(reset)


def _nested(
    fn: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    held: _Frame,
    how: str,
    source: Any,
) -> R:
    """A call on a name this call stack already holds: reuse the lease, never wait for it."""
    held.lease._check_for_write()  # lost: stop here
    session = _open(how, source, is_async=False)
    try:
        frame = _Frame(held.fencer, held.name, held.lease, session)
        if how != _FACTORY and _session_state(session).lease is held.lease:
            # the same unit of work: the call that bound this session commits it
            reset = _frames.set((*_frames.get(), frame))
            try:
                return fn(*args, **kwargs)
            finally:
                _frames.reset(reset)
        return _run_fenced(fn, args, kwargs, frame)
    finally:
        if how == _FACTORY:
            session.close()


async def _run_fenced_async(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    frame: _Frame,
    cancel_on_lost: bool,
) -> Any:
    """The async twin of :func:`_run_fenced`."""
    lease: AsyncLease = frame.lease
    session: AsyncSession = frame.session
    state = _session_state(session)
    previous = state.lease
    reset = _frames.set((*_frames.get(), frame))
    try:
        lease.bind(session)

        async def unit_of_work() -> Any:
            try:
                result = await fn(*args, **kwargs)
                lease._check_for_write()
                await session.commit()
            except BaseException:
                await session.rollback()
                raise
            return result

        if not cancel_on_lost:
            return await unit_of_work()
        return await _cancelled_on_loss(lease, unit_of_work())
    finally:
        state.lease = previous
        _frames.reset(reset)


async def _nested_async(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    held: _Frame,
    how: str,
    source: Any,
    cancel_on_lost: bool,
) -> Any:
    """The async twin of :func:`_nested`."""
    held.lease._check_for_write()
    session = _open(how, source, is_async=True)
    try:
        frame = _Frame(held.fencer, held.name, held.lease, session)
        if how != _FACTORY and _session_state(session).lease is held.lease:
            reset = _frames.set((*_frames.get(), frame))
            try:
                return await fn(*args, **kwargs)
            finally:
                _frames.reset(reset)
        return await _run_fenced_async(fn, args, kwargs, frame, cancel_on_lost)
    finally:
        if how == _FACTORY:
            await session.close()


async def _cancelled_on_loss(lease: AsyncLease, work: Any) -> Any:
    """Run ``work`` in a child task that the lease's loss cancels (LeaseLostError then).

    A child task, so that the loss cancels the body only: the caller's task
    is never cancelled by us, and a cancellation of the caller still reaches
    the body (awaiting a task forwards the cancellation to it) and is
    re-raised as such.  The child runs in a copy of this context, so
    ``current_lease()`` works in the body.
    """
    child = asyncio.ensure_future(work)

    def on_loss() -> None:
        if not child.done():
            child.cancel(f"sa-fence: lease {lease.name!r} was lost")

    lease._loss_hooks = (*lease._loss_hooks, on_loss)
    try:
        if lease._state.lost is not None:
            on_loss()
        return await child
    except asyncio.CancelledError:
        me = asyncio.current_task()
        lost = lease._state.lost
        if lost is not None and child.cancelled() and (me is None or me.cancelling() == 0):
            raise LeaseLostError(f"{lost} The fenced call was cancelled.") from None
        raise
    finally:
        lease._loss_hooks = tuple(h for h in lease._loss_hooks if h is not on_loss)


def fenced_methods(
    name: str,
    *,
    ttl: float,
    exclude: Iterable[str] = (),
    on_busy: OnBusy = "raise",
    timeout: float | None = None,
    renew: bool = False,
    max_hold: float | None = None,
    on_lost: OnLost | None = None,
    fail_fast: bool | None = None,
    fencer: Fencer | AsyncFencer | str = "fencer",
    session: SessionSource = "session",
    cancel_on_lost: bool | None = None,
) -> Callable[[C], C]:
    """Class decorator: apply :func:`fenced` with these arguments to every public method.

    Public methods are the plain functions defined in the class body whose
    name does not start with ``_``; ``exclude`` names methods to leave alone,
    and a method already decorated with :func:`fenced` keeps its own
    settings.  Every other method must have the parameters the template
    names, or the class is refused at definition time.  One public method
    calling another on the same name reuses the held lease (see
    :func:`fenced`, "Nested calls").
    """
    excluded = {exclude} if isinstance(exclude, str) else set(exclude)
    decorator = fenced(
        name,
        ttl=ttl,
        on_busy=on_busy,
        timeout=timeout,
        renew=renew,
        max_hold=max_hold,
        on_lost=on_lost,
        fail_fast=fail_fast,
        fencer=fencer,
        session=session,
        cancel_on_lost=cancel_on_lost,
    )

    def decorate(cls: C) -> C:
        if not isinstance(cls, type):
            raise TypeError(f"@fenced_methods decorates a class, got {cls!r}")
        methods = {
            attr: value
            for attr, value in vars(cls).items()
            if not attr.startswith("_") and inspect.isfunction(value)
        }
        unknown = excluded - set(methods)
        if unknown:
            raise ValueError(
                f"exclude names {sorted(unknown)} which are not public methods of "
                f"{cls.__qualname__} (its public methods: {sorted(methods) or 'none'})"
            )
        for attr, fn in methods.items():
            if attr in excluded or getattr(fn, _MARK, False):
                continue
            setattr(cls, attr, decorator(fn))
        return cls

    return decorate
