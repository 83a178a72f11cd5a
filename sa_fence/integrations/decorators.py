"""Repository-layer decorators: run a function or method under a fenced lease.

::

    @sa_fence.fenced("job:{job_id}", ttl=30, renew=True, fencer=fencer, session=Session)
    def finish_job(job_id: int, result: str) -> None:
        sa_fence.current_session().get(Job, job_id).result = result   # committed on return

docs/decorators.md tells the whole story.  The algorithm is written once, as generators
that ``yield`` every value an ``async def`` would ``await``: :func:`run_steps` sends plain
values straight back, :func:`await_steps` awaits each one first.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import functools
import inspect
import logging
import string
import sys
import time
from collections.abc import Callable, Coroutine, Generator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Protocol, TypeAlias, TypeVar, overload

from sqlalchemy.orm import Session, scoped_session, sessionmaker

from .. import telemetry as _telemetry
from ..errors import FencingConfigError, LeaseLostError, LeaseNotAcquiredError
from ..lease import protocol as proto
from ..lease.lifecycle import BaseLease, add_loss_hook, lose, remove_loss_hook
from ..lease.sync import Deadlines, Fencer, OnLost
from ..orm.flush import is_installed
from ..orm.session_state import state_for

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker

    from ..lease.aio import AsyncFencer, AsyncLease

log = logging.getLogger(__name__)  # a child of "sa_fence"

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=type)
#: What the algorithm's generators are: they yield values or awaitables, get results back.
_Steps: TypeAlias = Generator[Any, Any, R]

#: What ``session=`` takes: a session, a scoped session, a factory, or the name of one.
SessionSource: TypeAlias = (
    "Session | AsyncSession | scoped_session[Any] | async_scoped_session[Any] "
    "| sessionmaker[Any] | async_sessionmaker[Any] | Callable[[], Session | AsyncSession] | str"
)


class _SkippingDecorator(Protocol):
    """What ``fenced(..., on_busy="skip")`` returns: ``SKIPPED`` joins the (awaited) result."""

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
    """The type of :data:`SKIPPED`: a ``str`` enum, so a skipped call's result
    serializes as it is (JSON: the string ``"sa_fence.SKIPPED"``).  Test it with
    ``result == sa_fence.SKIPPED``: after a JSON round trip ``is`` no longer holds.
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
    session: Any = None  # the Session or AsyncSession the call runs on


#: The fenced calls running in this thread or asyncio task, outermost first.
_frames: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar(
    "sa_fence_fenced_calls", default=()
)


def _innermost(function: str) -> _Frame:
    frames = _frames.get()
    if not frames:
        raise LookupError(f"sa_fence.{function}() was called outside a @sa_fence.fenced call")
    return frames[-1]


def current_lease() -> Any:
    """The lease of the innermost :func:`fenced` call running in this context.

    A :class:`~sa_fence.Lease` (an :class:`~sa_fence.AsyncLease` in an ``async def``):
    ``current_lease().token`` for an idempotency key, or ``current_lease().check()`` between
    steps of long work. Raises ``LookupError`` outside a fenced call.
    """
    return _innermost("current_lease").lease


def current_session() -> Any:
    """The session of the innermost :func:`fenced` call running in this context.

    The ``Session`` (or ``AsyncSession``) the call opened or found, bound to its lease and
    committed when it returns. Raises ``LookupError`` outside a fenced call.
    """
    return _innermost("current_session").session


def _held(fencer: object, name: str) -> _Frame | None:
    """The innermost running call holding lease ``name`` of ``fencer`` (not released)."""
    for frame in reversed(_frames.get()):
        if frame.fencer is fencer and frame.name == name and not frame.lease.released:
            return frame
    return None


def _template_fields(template: object) -> list[str]:
    """The parameter names a lease name template formats (each field's root)."""
    if not isinstance(template, str):
        raise TypeError(
            f"the lease name template must be a str such as 'job:{{job_id}}', got {template!r}"
        )
    if not template:
        raise ValueError("the lease name template is empty; name the resource, e.g. 'job:{job_id}'")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(
            f"lease name template {template!r} is not a valid format string ({exc}); "
            "use str.format fields such as 'job:{job_id}' and double braces for literal ones"
        ) from None
    roots = [f.split(".", 1)[0].split("[", 1)[0] for f in fields]
    for f, root in zip(fields, roots, strict=True):
        if not root or root.isdigit():
            raise ValueError(
                f"lease name template {template!r} has a positional field {{{f}}}: "
                "name the parameter instead, e.g. 'job:{job_id}'"
            )
    return roots


class _NoneField(Exception):
    """A field of a lease name template is None (its ``args[0]``: the field)."""


class _NameFormatter(string.Formatter):
    """``str.format`` that refuses None: ``'job:{job_id}'`` filled with ``job_id=None`` would
    give every such call the one lease ``'job:None'``."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        got = super().get_field(field_name, args, kwargs)
        if got[0] is None:
            raise _NoneField(field_name)
        return got


_NAMES = _NameFormatter()


def _families() -> list[tuple[type, type, type, type]]:
    """(fencer, session, sessionmaker, scoped_session) of a def, then of an async def once
    sa_fence.lease.aio is loaded (until then none of the asyncio kinds can exist)."""
    sync = (Fencer, Session, sessionmaker, scoped_session)
    if "sa_fence.lease.aio" not in sys.modules:
        return [sync]
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker

    from ..lease.aio import AsyncFencer

    return [sync, (AsyncFencer, AsyncSession, async_sessionmaker, async_scoped_session)]


# How a session= value is used at each call.
_SESSION = "session"  # this very session
_SCOPED = "scoped"  # a scoped_session: its current session (not closed by us)
_FACTORY = "factory"  # a session factory: a new session per call, closed after it


def _session_kind(value: object, *, any_callable: bool) -> tuple[str, bool | None] | None:
    """(how it is used, is it asyncio's: True/False, None when unknown) or None."""
    for is_async, (_, session, maker, scoped) in enumerate(_families()):
        if isinstance(value, session):
            return _SESSION, bool(is_async)
        if isinstance(value, scoped):
            return _SCOPED, bool(is_async)
        if isinstance(value, maker) or (isinstance(value, type) and issubclass(value, session)):
            return _FACTORY, bool(is_async)
    return (_FACTORY, None) if any_callable and callable(value) else None


_WANTED = {  # what an async def / a plain def needs, by argument
    "fencer": ("a AsyncFencer", "a Fencer"),
    "session": (
        "an AsyncSession, async_scoped_session or async_sessionmaker",
        "a Session, scoped_session or sessionmaker",
    ),
}


@dataclass(slots=True)
class _Options:
    """The arguments of one :func:`fenced`, checked at decoration time."""

    name: str
    ttl: float
    on_busy: OnBusy
    timeout: float | None
    renew: bool
    max_hold: float | None
    on_lost: OnLost | None
    fail_fast: bool | None
    fencer: object
    session: object
    cancel_on_lost: bool | None
    fields: list[str] = field(init=False)
    #: Are the fencer and the session asyncio's (None: a name, or any callable)?
    sides: tuple[bool | None, bool | None] = field(init=False)
    how: str | None = field(init=False)  # how session= is used, unless it is a name

    def __post_init__(self) -> None:
        self.fields = _template_fields(self.name)
        ttl_ms = proto.ttl_to_ms(self.ttl)
        if self.on_busy not in _ON_BUSY:
            raise ValueError(f"on_busy must be one of {', '.join(_ON_BUSY)}, got {self.on_busy!r}")
        if self.on_busy != "wait" and self.timeout is not None:
            raise ValueError(
                f"timeout={self.timeout!r} applies only with on_busy='wait': pass "
                "on_busy='wait' to wait for a busy lease, or drop timeout"
            )
        proto.check_timeout(self.on_busy == "wait", self.timeout, ttl_ms / 1000)
        proto.check_lease_options(self.renew, self.on_lost, self.fail_fast)
        if self.max_hold is not None:
            proto.ttl_to_ms(self.max_hold, "max_hold")
            if not self.renew:
                raise ValueError(
                    f"max_hold={self.max_hold!r} caps renewal, so it needs renew=True (without "
                    "renewal the lease ends after its ttl anyway)"
                )
            if self.max_hold < self.ttl:
                raise ValueError(
                    f"max_hold={self.max_hold!r} is shorter than ttl={self.ttl!r}: the lease "
                    "would count as lost before it was ever renewed; use a shorter ttl or a "
                    "longer max_hold"
                )
        if self.cancel_on_lost is not None and not isinstance(self.cancel_on_lost, bool):
            raise TypeError(
                f"cancel_on_lost must be True, False or None, got {self.cancel_on_lost!r}"
            )
        sides = [i for i, family in enumerate(_families()) if isinstance(self.fencer, family[0])]
        if not sides and not (isinstance(self.fencer, str) and self.fencer.isidentifier()):
            raise TypeError(
                "fencer must be a Fencer or the name of a parameter / attribute of the first "
                f"argument holding one (AsyncFencer for an async def), got {self.fencer!r}"
            )
        if isinstance(self.session, str) and self.session.isidentifier():
            self.how, session_side = None, None
        elif (found := _session_kind(self.session, any_callable=True)) is None:
            raise TypeError(
                "session must be a Session, a scoped_session, a session factory (a sessionmaker, "
                "or any callable returning a Session; a session is opened and closed per call), "
                "or the name of a parameter / attribute of the first argument holding one "
                f"(their asyncio kinds for an async def), got {self.session!r}"
            )
        else:
            self.how, session_side = found
        self.sides = (bool(sides[0]) if sides else None), session_side


def _first_or_parameter(what: str, locator: str, bound: inspect.BoundArguments) -> Any:
    if locator in bound.arguments:
        return bound.arguments[locator]
    first = next(iter(bound.arguments.values()), None)
    if first is None or not hasattr(first, locator):
        raise TypeError(
            f"@fenced could not find the {what}: the call has no parameter {locator!r} and its "
            f"first argument ({type(first).__name__}) has no attribute {locator!r}. Pass "
            f"{what}=<name of the parameter or attribute>, or {what}=<the object> to fenced()"
        )
    return getattr(first, locator)


def _open(how: str, source: Any, is_async: bool) -> Any:
    """The session to run on: the session itself, a scoped session's current one, or a new one
    (no I/O), checked before the lease is taken: one that could not be fenced fails first."""
    session = source if how == _SESSION else source()
    made = isinstance(session, _families()[is_async][1])
    if made and is_installed(getattr(session, "sync_session", session)):
        return session
    close = getattr(session, "close", None)
    if how == _FACTORY and callable(close) and not inspect.iscoroutinefunction(close):
        close()
    if made:
        raise FencingConfigError(
            f"@fenced's session {source!r} has no sa-fence flush hook, so the lease would fence "
            "nothing: call sa_fence.install() on it, its sessionmaker or its Session class first"
        )
    raise TypeError(
        f"@fenced's session {'factory' if how == _FACTORY else 'registry'} {source!r} returned "
        f"a {type(session).__name__}, not {'an AsyncSession' if is_async else 'a Session'}"
    )


_hold_limits = Deadlines("sa-fence-max-hold")  # (reset in a forked child, as every one is)


def run_steps(steps: _Steps[R]) -> R:
    """Drive ``steps`` in a plain def: each value it yields is already the result."""
    value: Any = None
    try:
        while True:
            value = steps.send(value)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def await_steps(steps: _Steps[R]) -> R:
    """Drive ``steps`` in an async def: await each awaitable it yields, then send back
    its result or throw in its exception."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            awaitable = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            value, error = await awaitable, None
        except BaseException as exc:  # thrown into the generator above
            value, error = None, exc


@dataclass(frozen=True, slots=True)
class _Fenced:
    """One fenced function, def or async def: its calls, as steps (see the module doc)."""

    options: _Options
    fn: Callable[..., Any]
    sig: inspect.Signature
    is_async: bool

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Steps[Any]:
        """One call: acquire, open, run bound, close, release."""
        options = self.options
        bound = self.sig.bind(*args, **kwargs)
        bound.apply_defaults()
        try:
            lease_name = _NAMES.vformat(options.name, (), bound.arguments)
        except _NoneField as exc:
            raise ValueError(
                f"could not fill lease name template {options.name!r} from the arguments of "
                f"{self.fn.__qualname__}(): {{{exc.args[0]}}} is None, which would give every "
                "such call one lease named after None; pass a value, or give the resource a "
                "name of its own in the template"
            ) from None
        except (KeyError, AttributeError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(
                f"could not fill lease name template {options.name!r} from the arguments of "
                f"{self.fn.__qualname__}(): {type(exc).__name__}: {exc}"
            ) from None
        lease_name = proto.check_name(lease_name)
        fencer, how, source = self.locate(bound)
        body = functools.partial(self.fn, *args, **kwargs)
        session = _open(how, source, self.is_async)  # before the lease: see _open
        try:
            held = _held(fencer, lease_name)
            if held is not None:  # this call stack holds the name: reuse it, never wait for it
                held.lease.check(for_write=True)  # lost: stop here
                return (yield from self.in_session(body, held, how, session))
            try:
                with _telemetry.naming(options.name):  # metrics name the template, not the name
                    lease = yield fencer.acquire(
                        lease_name,
                        options.ttl,
                        on_lost=options.on_lost,
                        blocking=options.on_busy == "wait",
                        timeout=options.timeout,
                        renew=options.renew,
                        fail_fast=options.fail_fast,
                    )
            except LeaseNotAcquiredError:
                if options.on_busy != "skip":
                    raise
                log.info("lease %r is busy; skipped %s()", lease_name, self.fn.__qualname__)
                return SKIPPED
            limit = None if options.max_hold is None else self.hold_limit(lease, options.max_hold)
            try:
                frame = _Frame(fencer, lease_name, lease)
                return (yield from self.in_session(body, frame, how, session))
            finally:
                if limit is not None:
                    limit()
                yield (lease.__aexit__ if self.is_async else lease.__exit__)(None, None, None)
        finally:
            if how == _FACTORY:
                yield session.close()

    def locate(self, bound: inspect.BoundArguments) -> tuple[Any, str, Any]:
        """The fencer, how to use the session, and its source: found without I/O, so a
        failure comes before anything is written."""
        fencer, how, source = self.options.fencer, self.options.how, self.options.session
        if isinstance(fencer, str):
            fencer = _first_or_parameter("fencer", fencer, bound)
            kind = _families()[self.is_async][0]
            if not isinstance(fencer, kind):
                raise TypeError(
                    f"@fenced found fencer {self.options.fencer!r} but it is a "
                    f"{type(fencer).__name__}, not a {kind.__name__}"
                )
        if how is None:
            source = _first_or_parameter("session", str(source), bound)
            found = _session_kind(source, any_callable=False)
            if found is None or found[1] != self.is_async:
                want = "an AsyncSession" if self.is_async else "a Session"
                raise TypeError(
                    f"@fenced found session {self.options.session!r} but it is a "
                    f"{type(source).__name__}, not {want} (or its scoped_session or sessionmaker)"
                )
            how = found[0]
        return fencer, how, source

    def hold_limit(self, lease: BaseLease[Any], max_hold: float) -> Callable[[], object]:
        """Mark ``lease`` lost once it reaches ``max_hold``; returns what cancels that."""
        at = lease.acquired_at + max_hold
        message = (
            f"lease {lease.name!r} (token {lease.token}) reached its max_hold of {max_hold:g} s, "
            "the cap on its renewal: it is no longer renewed and counts as lost. Stop the "
            "work; its writes will be refused."
        )
        if self.is_async:  # the event loop's timer: no thread
            delay = max(0.0, at - time.monotonic())
            return asyncio.get_running_loop().call_later(delay, lose, lease, message).cancel
        entry = _hold_limits.add(at, lose, lease, message)  # (a failure is logged there)
        return functools.partial(_hold_limits.cancel, entry)

    def in_session(
        self, body: Callable[[], Any], holder: _Frame, how: str, session: Any
    ) -> _Steps[Any]:
        """Run the unit of work on ``session`` bound to ``holder.lease`` (cancelled by its
        loss with ``cancel_on_lost``), then restore the session's previous binding."""
        frame = _Frame(holder.fencer, holder.name, holder.lease, session)
        state = state_for(getattr(session, "sync_session", session))  # an AsyncSession's own
        previous = state.lease
        # a nested call on the session its outer call bound: the outer call commits it
        joined = how != _FACTORY and previous is frame.lease
        reset = _frames.set((*_frames.get(), frame))
        try:
            if joined:
                return (yield body())
            if how != _FACTORY and previous is not None and not previous.released:
                if self.is_async and self.options.cancel_on_lost is not False:
                    body = functools.partial(_cancelled_on_loss, body, frame.lease)
                return (yield from self.joined_under(body, frame.lease, previous, session))
            frame.lease.bind(session)
            if not self.is_async:
                return (yield run_steps(_unit_of_work(body, frame)))
            if self.options.cancel_on_lost is not False:  # the body, not the commit after it
                body = functools.partial(_cancelled_on_loss, body, frame.lease)
            return (yield await_steps(_unit_of_work(body, frame)))
        finally:
            if not joined:
                state.lease = previous
            _frames.reset(reset)

    def joined_under(
        self, body: Callable[[], Any], lease: Any, outer: Any, session: Any
    ) -> _Steps[Any]:
        """Run the body on ``session``, which another lease (``outer``: an enclosing call's, or
        the caller's own bind) is bound to, as part of that unit of work: its writes flushed
        under ``lease``, the transaction checked against both leases at the COMMIT the outer
        code sends; it neither commits nor rolls back.  What the outer code wrote before is
        flushed first, under ``outer``: committing it here would let it skip the outer lease's
        check (a stale outer holder's work landing under the nested lease)."""
        yield session.flush()  # (begins the transaction armed with ``outer``, if anything)
        yield self.rebind(lease, session)  # armed now too, if a transaction is open
        try:
            result = yield body()
            yield session.flush()  # its writes under its lease, not the outer one
        except BaseException:
            try:
                yield self.rebind(outer, session)
            except Exception:  # a transaction that failed cannot commit: unarmed is fine
                state_for(getattr(session, "sync_session", session)).lease = outer
            raise
        yield self.rebind(outer, session)  # armed too if the body began the transaction
        return result

    def rebind(self, lease: Any, session: Any) -> Any:
        """``lease.bind(session)``; on an AsyncSession through ``run_sync``, as binding
        mid-transaction sends the arm (awaited by the caller)."""
        if self.is_async:
            return session.run_sync(_bind_sync, lease)
        return lease.bind(session)


def _bind_sync(sync_session: Session, lease: Any) -> None:
    lease.bind(sync_session)


def _unit_of_work(body: Callable[[], Any], frame: _Frame) -> _Steps[Any]:
    """Run the body, commit (unless the lease was lost) or roll back."""
    try:
        result = yield body()
        frame.lease.check(for_write=True)  # lost (renewal, max_hold) or released: commit nothing
        yield frame.session.commit()
    except BaseException:
        yield frame.session.rollback()
        raise
    return result


async def _cancelled_on_loss(body: Callable[[], Any], lease: AsyncLease) -> Any:
    """Await the body, cancelled by the lease's loss (LeaseLostError then) in this very task, as
    ``asyncio.timeout()`` cancels: the body sees the caller's task (an ``async_scoped_session``
    keyed on it gives it the call's session), and a cancellation from outside stays one."""
    task = asyncio.current_task()
    assert task is not None  # (awaited by the decorated async def)
    loop, running, fired = task.get_loop(), True, False

    def cancel() -> None:  # on the loop, never inside the task's own step
        nonlocal fired
        if running and not fired:
            fired = True
            task.cancel(f"sa-fence: lease {lease.name!r} was lost")

    def on_loss() -> None:  # any thread: lease.check() in asyncio.to_thread may find the loss
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to cancel
            loop.call_soon_threadsafe(cancel)

    add_loss_hook(lease, on_loss)
    cancels = task.cancelling()
    try:
        if (lost := lease.lost_reason) is not None:  # lost before the hook: the body never runs
            raise LeaseLostError(f"{lost} The fenced call was cancelled.")
        return await body()
    except asyncio.CancelledError:
        if fired and task.cancelling() == cancels + 1 and (lost := lease.lost_reason):
            raise LeaseLostError(f"{lost} The fenced call was cancelled.") from None
        raise  # (also) cancelled from outside
    finally:
        running = False
        if fired:
            task.uncancel()
        remove_loss_hook(lease, on_loss)


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

    ``name`` is a ``str.format`` template filled from the call's arguments by parameter name
    (``"job:{job_id}"``, ``"sheet:{sheet.id}"``).  ``fencer``: a :class:`~sa_fence.Fencer`, or
    (the default) a name looked up among the call's parameters, then on its first argument
    (``self.fencer``). ``session``: a ``Session``, a ``scoped_session`` (its current session), a
    session factory (a session is opened and closed per call), or a name looked up like
    ``fencer``; :func:`current_session` returns it in the body.

    ``on_busy`` when another owner holds the lease: ``"raise"``
    :class:`~sa_fence.LeaseNotAcquiredError`, ``"skip"`` the body and return
    :data:`~sa_fence.SKIPPED`, or ``"wait"`` up to ``timeout`` seconds (default ``ttl``).
    ``ttl``, ``renew``, ``on_lost`` and ``fail_fast`` go to :meth:`Fencer.acquire`; ``max_hold``
    (with ``renew=True``) caps renewal, after which the lease counts as lost.

    On return the session is committed, or rolled back with :class:`~sa_fence.LeaseLostError` if
    the lease was lost meanwhile; if the body raises, it is rolled back.  A nested call on the
    same name and Fencer reuses the held lease.  A call on a session another held lease is bound
    to (a nested call on another name) joins that unit of work: it neither commits nor rolls
    back, and if its body raises, the exception reaches the outer code, whose rollback undoes
    its writes (caught and committed, they commit).  On an ``async def``: an
    :class:`~sa_fence.AsyncFencer` and the asyncio sessions, and ``cancel_on_lost`` (default
    True) cancels the body when the lease is lost. Bad arguments raise
    ``TypeError``/``ValueError`` at decoration time.  The wrapper keeps the function's
    signature.  docs/decorators.md has the details.
    """
    return functools.partial(_decorate, _Options(**locals()))  # every parameter, by name


def _decorate(options: _Options, fn: Callable[P, R]) -> Callable[P, Any]:
    if not callable(fn):
        raise TypeError(f"@fenced decorates a function or method, got {fn!r}")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(  # its body would run after the call: unfenced, the lease released
            f"@fenced cannot wrap {fn.__qualname__}, a generator function: its body runs only "
            "as the caller iterates, after the fenced call has committed and released the "
            "lease. Return a list instead, or iterate inside a fenced function (fenced_methods: "
            "leave it out with exclude=[...])"
        )
    is_async = inspect.iscoroutinefunction(fn)
    if not is_async and proto.calls_async(fn):  # (an object whose __call__ is an async def)
        raise TypeError(
            f"@fenced cannot wrap {fn!r}: its __call__ is an async def, which a callable "
            "object does not show as one. Decorate an async def (or the method) instead"
        )
    if options.cancel_on_lost is not None and not is_async:
        raise ValueError(
            f"cancel_on_lost applies only to an async def (a thread cannot be cancelled); "
            f"{fn.__qualname__} is a plain def: drop cancel_on_lost and call "
            "current_lease().check() between steps instead"
        )
    for what, side, given in zip(
        _WANTED, options.sides, (options.fencer, options.session), strict=True
    ):
        if side is not None and side != is_async:  # an async def needs the asyncio kinds
            raise TypeError(
                f"@fenced on {'an async def' if is_async else 'a plain def'} ({fn.__qualname__}) "
                f"needs {what}=<{_WANTED[what][not is_async]}>, got {type(given).__name__}"
            )
    sig = inspect.signature(fn)
    params = sig.parameters
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [f for f in options.fields if f not in params and not has_var_kw]
    if unknown:
        raise ValueError(
            f"lease name template {options.name!r} uses {', '.join(map(repr, unknown))}, which "
            f"{fn.__qualname__}() has no parameter for (parameters: "
            f"{', '.join(params) or 'none'}); name one of its parameters"
        )
    fenced = _Fenced(options, fn, sig, is_async)
    wrapper: Callable[P, Any]
    if is_async:
        from ..lease import aio  # noqa: F401  # loads the asyncio kinds (see _families)

        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            return await await_steps(fenced.call(args, kwargs))

    else:

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            return run_steps(fenced.call(args, kwargs))

    setattr(wrapper, _MARK, True)
    setattr(wrapper, "__signature__", sig)  # noqa: B010  # getfullargspec reads it
    return wrapper


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

    Public methods are the functions defined in the class body whose name does not
    start with ``_``; ``exclude`` names methods to leave alone, and a method with
    its own :func:`fenced` keeps it.  Every other method must have the parameters
    the template names, or the class is refused at definition time.
    """
    options = _Options(**{k: v for k, v in locals().items() if k != "exclude"})
    if not isinstance(exclude, str | Iterable):
        raise TypeError(f"exclude must be a method name or names, got {exclude!r}")
    excluded = {exclude} if isinstance(exclude, str) else set(exclude)

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
            setattr(cls, attr, _decorate(options, fn))
        return cls

    return decorate
