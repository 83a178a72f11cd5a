"""Repository-layer decorators: run a method under a fenced lease.

::

    class JobRepository:
        def __init__(self, session: Session, fencer: sa_fence.Fencer) -> None:
            self.session = session          # found by attribute name "session"
            self.fencer = fencer            # found by attribute name "fencer"

        @sa_fence.fenced("job:{job_id}", ttl=30, renew=True)
        def finish(self, job_id: int, result: str) -> None:
            self.session.get(Job, job_id).result = result   # committed on return

Each call formats the lease name from the call's arguments, acquires the
lease (contention: raise, skip or wait), binds it to the session, runs the
body, commits (or rolls back if the body raised), restores the session's
previous binding and releases the lease.  :func:`fenced_methods` does the
same for every public method of a class.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import inspect
import logging
import string
import sys
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Protocol, TypeVar, overload

from sqlalchemy.orm import Session

from . import _protocol as proto
from ._lease import BaseLease, Fencer, Lease, OnLost
from .errors import LeaseLostError, LeaseNotAcquiredError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from ._async import AsyncFencer, AsyncLease
    from ._flush import _SessionState

log = logging.getLogger("sa_fence")

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=type)


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


class Skipped(enum.Enum):
    """The type of :data:`SKIPPED`."""

    SKIPPED = "SKIPPED"

    def __repr__(self) -> str:
        return "sa_fence.SKIPPED"


#: Returned instead of running the body when ``on_busy="skip"`` and the lease is held.
SKIPPED = Skipped.SKIPPED

_current: contextvars.ContextVar[BaseLease[Any]] = contextvars.ContextVar("sa_fence_current_lease")


def current_lease() -> Any:
    """The lease of the innermost :func:`fenced` call running in this context.

    A :class:`~sa_fence.Lease`, or an :class:`~sa_fence.AsyncLease` inside an
    ``async def`` fenced call (a contextvar: each asyncio task sees its own).

    For the body's own use: ``current_lease().token`` as part of an
    idempotency key for external side effects, or ``current_lease().check()``
    between steps of long work.  Raises ``LookupError`` outside a fenced call.
    """
    try:
        return _current.get()
    except LookupError:
        raise LookupError(
            "sa_fence.current_lease() was called outside a @sa_fence.fenced call"
        ) from None


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


def _async_kinds() -> tuple[type, type] | None:
    """(AsyncFencer, AsyncSession) if the asyncio front end is loaded, else None.

    Not imported here: an AsyncFencer or AsyncSession can only exist once its
    module is loaded, and sync users need not load SQLAlchemy's asyncio.
    """
    if "sa_fence._async" not in sys.modules:
        return None
    from sqlalchemy.ext.asyncio import AsyncSession

    from ._async import AsyncFencer

    return AsyncFencer, AsyncSession


def _check_locator(what: str, value: object, kind: type) -> None:
    if (isinstance(value, str) and value.isidentifier()) or isinstance(value, kind):
        return
    kinds = _async_kinds()
    if kinds is not None and isinstance(value, kinds[0] if kind is Fencer else kinds[1]):
        return
    raise TypeError(
        f"{what} must be a {kind.__name__} or the name of a parameter / attribute of "
        f"the first argument holding one (Async{kind.__name__} for an async def), got {value!r}"
    )


def _check_sides(fn: Callable[..., Any], is_async: bool, fencer: object, session: object) -> None:
    """An async def needs an AsyncFencer and AsyncSession given explicitly, a def the sync ones."""
    for what, value, sync_kind in (("fencer", fencer, Fencer), ("session", session, Session)):
        if isinstance(value, str):
            continue
        if isinstance(value, sync_kind) == is_async:
            want = f"Async{sync_kind.__name__}" if is_async else sync_kind.__name__
            kind = "an async def" if is_async else "a plain def"
            raise TypeError(
                f"@fenced on {kind} ({fn.__qualname__}) needs {what}=<a {want}>, got "
                f"{type(value).__name__}"
            )


def _locate(what: str, locator: object, kind: type, bound: inspect.BoundArguments) -> Any:
    if not isinstance(locator, str):
        return locator
    if locator in bound.arguments:
        found = bound.arguments[locator]
    else:
        args = list(bound.arguments.values())
        first = args[0] if args else None
        if first is None or not hasattr(first, locator):
            raise TypeError(
                f"@fenced could not find the {what}: the call has no parameter "
                f"{locator!r} and its first argument ({type(first).__name__}) has no "
                f"attribute {locator!r}. Pass {what}=<name of the parameter or attribute>, "
                f"or {what}=<a {kind.__name__}> to fenced()"
            )
        found = getattr(first, locator)
    if not isinstance(found, kind):
        raise TypeError(
            f"@fenced found {what} {locator!r} but it is a {type(found).__name__}, "
            f"not a {kind.__name__}"
        )
    return found


@overload
def fenced(
    name: str,
    *,
    ttl: float,
    on_busy: Literal["skip"],
    timeout: float | None = ...,
    renew: bool = ...,
    on_lost: OnLost | None = ...,
    fail_fast: bool | None = ...,
    fencer: Fencer | AsyncFencer | str = ...,
    session: Session | AsyncSession | str = ...,
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
    on_lost: OnLost | None = ...,
    fail_fast: bool | None = ...,
    fencer: Fencer | AsyncFencer | str = ...,
    session: Session | AsyncSession | str = ...,
    cancel_on_lost: bool | None = ...,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
def fenced(
    name: str,
    *,
    ttl: float,
    on_busy: OnBusy = "raise",
    timeout: float | None = None,
    renew: bool = False,
    on_lost: OnLost | None = None,
    fail_fast: bool | None = None,
    fencer: Fencer | AsyncFencer | str = "fencer",
    session: Session | AsyncSession | str = "session",
    cancel_on_lost: bool | None = None,
) -> Callable[[Callable[P, R]], Callable[P, Any]]:
    """Run the decorated function under lease ``name`` with its session fenced.

    ``name`` is a ``str.format`` template filled from the call's arguments by
    parameter name (``"job:{job_id}"``, ``"sheet:{sheet.id}"``).

    ``fencer`` and ``session``: an object, or (the default) a name looked up
    first among the call's parameters, then as an attribute of the first
    argument (``self.fencer``, ``self.session`` for a repository method).

    ``on_busy`` when another owner holds the lease: ``"raise"``
    :class:`~sa_fence.LeaseNotAcquiredError`; ``"skip"`` the body and return
    :data:`~sa_fence.SKIPPED`; ``"wait"`` up to ``timeout`` seconds (default:
    ``ttl``), then raise.  ``ttl``, ``renew``, ``on_lost`` and ``fail_fast``
    are passed to :meth:`Fencer.acquire`.

    On return the session is committed, and if the body raises it is rolled
    back; either way the session's previous binding is restored and the lease
    released.  Bad arguments raise ``TypeError``/``ValueError`` here, at
    decoration time, where they can be found.

    On an ``async def`` the same options apply, with an
    :class:`~sa_fence.AsyncFencer` and an ``AsyncSession``; the call is
    awaited, commits with ``await session.commit()``, and, with
    ``cancel_on_lost`` (default True; async only), a lease found lost while
    the body runs cancels the body, rolls back and raises
    :class:`~sa_fence.LeaseLostError`.
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
    if on_lost is not None and not callable(on_lost):
        raise TypeError(f"on_lost must be a callable taking the lease, got {on_lost!r}")
    if fail_fast is not None and not isinstance(fail_fast, bool):
        raise TypeError(f"fail_fast must be True, False or None, got {fail_fast!r}")
    _check_locator("fencer", fencer, Fencer)
    _check_locator("session", session, Session)
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
            from sqlalchemy.ext.asyncio import AsyncSession

            from ._async import AsyncFencer

            on_lost_any: Any = on_lost  # called with the AsyncLease

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                lease_name, bound = lease_name_of(args, kwargs)
                the_fencer: AsyncFencer = _locate("fencer", fencer, AsyncFencer, bound)
                the_session: AsyncSession = _locate("session", session, AsyncSession, bound)
                try:
                    lease = await the_fencer.acquire(
                        lease_name, ttl, on_lost=on_lost_any, **acquire_options
                    )
                except LeaseNotAcquiredError:
                    return skipped(lease_name)
                return await _run_fenced_async(
                    fn, args, kwargs, lease, the_session, cancel_on_lost is not False
                )

            setattr(async_wrapper, _MARK, True)
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            lease_name, bound = lease_name_of(args, kwargs)
            the_fencer: Fencer = _locate("fencer", fencer, Fencer, bound)
            the_session: Session = _locate("session", session, Session, bound)
            try:
                lease = the_fencer.acquire(lease_name, ttl, on_lost=on_lost, **acquire_options)
            except LeaseNotAcquiredError:
                return skipped(lease_name)
            return _run_fenced(fn, args, kwargs, lease, the_session)

        setattr(wrapper, _MARK, True)
        return wrapper

    return decorate


def _run_fenced(
    fn: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lease: Lease,
    session: Session,
) -> R:
    from ._flush import _state_for

    state: _SessionState = _state_for(session)
    previous = state.lease
    reset = _current.set(lease)
    try:
        lease.bind(session)
        try:
            result = fn(*args, **kwargs)
            session.commit()
        except BaseException:
            session.rollback()
            raise
        return result
    finally:
        state.lease = previous
        _current.reset(reset)
        lease._release_on_exit()


async def _run_fenced_async(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lease: AsyncLease,
    session: AsyncSession,
    cancel_on_lost: bool,
) -> Any:
    """The async twin of :func:`_run_fenced`: bind, run, commit or roll back, restore, release."""
    from ._flush import _state_for

    state: _SessionState = _state_for(session.sync_session)
    previous = state.lease
    reset = _current.set(lease)
    try:
        lease.bind(session)

        async def unit_of_work() -> Any:
            try:
                result = await fn(*args, **kwargs)
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
        _current.reset(reset)
        await lease._release_on_exit()


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
    on_lost: OnLost | None = None,
    fail_fast: bool | None = None,
    fencer: Fencer | AsyncFencer | str = "fencer",
    session: Session | AsyncSession | str = "session",
    cancel_on_lost: bool | None = None,
) -> Callable[[C], C]:
    """Class decorator: apply :func:`fenced` with these arguments to every public method.

    Public methods are the plain functions defined in the class body whose
    name does not start with ``_``; ``exclude`` names methods to leave alone,
    and a method already decorated with :func:`fenced` keeps its own
    settings.  Every other method must have the parameters the template
    names, or the class is refused at definition time.
    """
    excluded = {exclude} if isinstance(exclude, str) else set(exclude)
    decorator = fenced(
        name,
        ttl=ttl,
        on_busy=on_busy,
        timeout=timeout,
        renew=renew,
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
