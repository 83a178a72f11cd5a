"""Metrics, spans and log fields: what sa-fence tells an OpenTelemetry SDK.

Public here: :class:`Telemetry` (where a fencer's metrics and spans go) and
:func:`default_name_pattern`; the rest are the hooks the front ends call::

    telemetry = sa_fence.telemetry.Telemetry(meter_provider=meters, tracer_provider=tracers)
    fencer = sa_fence.Fencer(redis_client, engine, telemetry=telemetry)

A lease is one span, ``sa_fence.lease``, from acquire to release; a fenced flush and its
commit check are a span each.  Metric attributes are bounded: a lease's *pattern*, never its
name or owner.  Only the OpenTelemetry API is used; without it everything is a no-op.
docs/observability.md lists the signals; the front ends call the hooks at the bottom.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from . import errors

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import trace as otel_trace
except ImportError:  # the API is optional: sa-fence then reports nothing (its own no-ops)
    otel_context = None  # type: ignore[assignment]
    otel_metrics = None  # type: ignore[assignment]
    otel_trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from ._lease_view import LeaseView

log = logging.getLogger(__name__)

__all__ = ["Telemetry", "default_name_pattern"]

F = TypeVar("F", bound=Callable[..., Any])

SCOPE = "sa_fence"  # the instrumentation scope (meter and tracer name)

# Attribute keys (all of bounded cardinality).
PATTERN = "sa_fence.lease.pattern"
OUTCOME = "sa_fence.outcome"
CHECK = "sa_fence.check"
RELEASE = "sa_fence.release"  # on the lease's span: released, expired
TOKEN = "sa_fence.token"  # on the lease's span (never a metric attribute)
ACQUIRE_SECONDS = "sa_fence.acquire.duration"  # on the lease's span

# Where a stale write was refused.
LEASE_SCOPE = "lease_scope"  # the register check at COMMIT
ROW_FENCE = "row_fence"  # a fenced UPDATE/DELETE matched no row (at the flush)
GUARD = "guard"  # the database-side guard trigger

#: The acquire outcome of a failure (None: a bad argument, refused before anything was
#: sent, is no acquire); a CancelledError is "cancelled", anything else "error".
_OUTCOMES: tuple[tuple[type[BaseException], str | None], ...] = (
    (errors.LeaseNotAcquiredError, "busy"),
    (errors.LeaseBackendError, "backend_error"),
    (errors.FencingConfigError, "setup_error"),
    (errors.LeaseLostError, "lost"),  # the lease expired before its token was confirmed
    (TypeError, None),
    (ValueError, None),
)

#: Histogram buckets in seconds: from half a millisecond (a commit check) to
#: ten minutes (a long hold).  The SDK's default buckets are for milliseconds.
_SUB_SECOND = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
BUCKETS = (*_SUB_SECOND, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

OTHER = "other"

_UUID = re.compile(
    r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"
)
_HEX = re.compile(r"(?<![0-9a-zA-Z])(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{16,}")
_DIGITS = re.compile(r"\d+")


def default_name_pattern(name: str) -> str:
    """A lease name with its identifiers replaced: ``"job:42"`` -> ``"job:{n}"``.

    UUIDs and hex strings of 16 or more characters become ``{id}``, runs of
    digits ``{n}``.  Names with other unbounded parts (a tenant slug, an
    e-mail) need ``Telemetry(name_pattern=...)``, or the ``"other"`` cap.
    """
    name = _UUID.sub("{id}", name)
    name = _HEX.sub("{id}", name)
    return _DIGITS.sub("{n}", name)


#: The lease name template of the ``@fenced`` call acquiring right now.
_template: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "sa_fence_name_template", default=None
)


@contextmanager
def naming(template: str) -> Iterator[None]:
    """Within the block, leases acquired are reported under ``template`` (the decorator's)."""
    reset = _template.set(template)
    try:
        yield
    finally:
        _template.reset(reset)


class _NoOp:
    """Instruments, tracer and span when the OpenTelemetry API is not installed."""

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        pass

    add = record = set_attribute = set_attributes = add_event = _nothing
    set_status = record_exception = end = _nothing


_NOOP = _NoOp()

# One lock for every tally, held for a dict update only.  A forked child gets a fresh one
# (another thread may have held it) and drops the pending measurements (the parent reports them).
_tally_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _tally_lock
    _tally_lock = threading.Lock()
    for state in list(_providers.values()):
        state.pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Tally:
    """A counter kept in the process, reported by an ``ObservableCounter`` callback
    (cheaper than the API's ``Counter``: docs/observability.md, "Metrics")."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[frozenset[tuple[str, str]], int] = {}

    def add(self, amount: int, attributes: Mapping[str, str] | None = None) -> None:
        key = frozenset(attributes.items()) if attributes else frozenset()
        with _tally_lock:
            self.counts[key] = self.counts.get(key, 0) + amount

    def observe(self, options: Any = None) -> Iterable[Any]:
        """The ObservableCounter callback: every attribute set's total so far."""
        with _tally_lock:
            items = list(self.counts.items())
        return [otel_metrics.Observation(total, dict(key)) for key, total in items]


#: Pending measurements past which the thread adding one records them all itself.
PENDING_LIMIT = 512
_ADVICE = "explicit_bucket_boundaries_advisory"  # create_histogram's bucket advice (API 1.30+)


try:  # does Histogram.record accept context= (OpenTelemetry API 1.26+)?
    _RECORD_TAKES_CONTEXT = "context" in inspect.signature(otel_metrics.Histogram.record).parameters
except (AttributeError, TypeError, ValueError):  # no API, or no signature to read
    _RECORD_TAKES_CONTEXT = False


class _Provider:
    """What sa-fence keeps per meter provider: its tallies by counter name, and its histogram
    measurements pending, with their context, until a reader collects (docs/observability.md,
    "Metrics")."""

    __slots__ = ("pending", "tallies")

    def __init__(self) -> None:
        self.tallies: dict[str, _Tally] = {}
        # a deque: appends and pops are atomic, so two threads never take the same item
        self.pending: deque[tuple[Any, float, Mapping[str, str], Any]] = deque()

    def counter(self, meter: Any, name: str, unit: str, description: str) -> _Tally:
        """The tally of counter ``name``: made, and its callback registered, once."""
        with _tally_lock:
            tally = self.tallies.get(name)
            if tally is not None:
                return tally
            first = not self.tallies
            tally = self.tallies[name] = _Tally()
        # the first counter's callback also records the pending histograms
        callbacks = [self.drain, tally.observe] if first else [tally.observe]
        meter.create_observable_counter(
            name, callbacks=callbacks, unit=unit, description=description
        )
        return tally

    def drain(self, options: Any = None) -> Iterable[Any]:
        """An ObservableCounter callback: record what is pending, observe nothing."""
        items = self.pending
        for _ in range(len(items)):  # what is there now; later ones wait for the next call
            try:
                histogram, amount, attributes, context = items.popleft()
            except IndexError:  # another thread took the rest
                break
            if _RECORD_TAKES_CONTEXT:
                histogram.record(amount, attributes, context=context)
            else:
                histogram.record(amount, attributes)
        return ()


class _Histogram:
    """A histogram whose measurements wait in its provider's ``pending`` until a reader
    collects (at most ``PENDING_LIMIT``: past it the thread adding one records them all)."""

    __slots__ = ("histogram", "provider", "proxy")

    def __init__(self, meter: Any, name: str, description: str, provider: _Provider) -> None:
        takes = inspect.signature(meter.create_histogram).parameters
        advice = {_ADVICE: BUCKETS} if _ADVICE in takes else {}  # else the SDK's default buckets
        histogram = meter.create_histogram(name, unit="s", description=description, **advice)
        self.histogram = histogram
        self.provider = provider
        # The API's proxy (_ProxyHistogram: no meter provider set yet)? It drops
        # measurements until one is set: sa-fence then takes none (nor their context).
        self.proxy = hasattr(histogram, "_real_instrument")

    def record(self, amount: float, attributes: Mapping[str, str]) -> None:
        histogram = self.histogram
        if self.proxy and histogram._real_instrument is None:  # idle
            return
        items = self.provider.pending
        items.append((histogram, amount, attributes, otel_context.get_current()))
        if len(items) >= PENDING_LIMIT:
            self.provider.drain()


#: Per meter provider (``_GLOBAL``: the global one).
_providers: weakref.WeakKeyDictionary[Any, _Provider] = weakref.WeakKeyDictionary()


class _Global:
    """Stands for the global meter provider as a key of ``_providers``."""


_GLOBAL = _Global()


def _provider_state(meter_provider: Any) -> _Provider:
    """Shared by every Telemetry reporting to ``meter_provider``: a provider keeps the first
    observable instrument of a name (and its callbacks), so a second one's would never run."""
    key = _GLOBAL if meter_provider is None else meter_provider
    with _tally_lock:
        try:
            state = _providers.get(key)
            if state is None:
                state = _providers[key] = _Provider()
        except TypeError:  # a provider that cannot be weakly referenced: not shared
            state = _Provider()
    return state


#: Telemetry attribute -> (metric name, unit, description) of each counter.
_COUNTERS = {
    "acquires": (
        "sa_fence.lease.acquires",
        "{acquire}",
        "Lease acquisitions, by outcome (granted, busy, backend_error, "
        "setup_error, lost, cancelled, error).",
    ),
    "renewals": (
        "sa_fence.lease.renewals",
        "{renewal}",
        "Background renewals of leases, by outcome (ok, failed).",
    ),
    "lost": (
        "sa_fence.lease.lost",
        "{lease}",
        "Leases found lost while held (renewal failed or ran out, extend "
        "found another owner, max_hold reached).",
    ),
    "stale_refused": (
        "sa_fence.write.stale_refused",
        "{refusal}",
        "Writes refused because a newer lease of the name was granted, by "
        "where (lease_scope: at COMMIT; row_fence: at the flush; guard: a trigger).",
    ),
    "unfenced_refused": (
        "sa_fence.write.unfenced_refused",
        "{refusal}",
        "Writes of fenced rows refused because no lease was bound.",
    ),
}
#: Telemetry attribute -> (metric name, description) of each histogram (seconds).
_HISTOGRAMS = {
    "acquire_duration": (
        "sa_fence.lease.acquire.duration",
        "Time an acquire took (waiting for a busy lease included), by outcome.",
    ),
    "hold_duration": (
        "sa_fence.lease.hold.duration",
        "Time from grant to release, by outcome (released, expired).",
    ),
    "first_write_delay": (
        "sa_fence.lease.first_write.delay",
        "Time from grant to the first write of a session or connection bound to it.",
    ),
    "commit_check_duration": (
        "sa_fence.commit_check.duration",
        "Time of the lease register check and COMMIT (one round trip), by outcome.",
    ),
}


class Telemetry:
    """Where sa-fence reports: a meter and a tracer, and how lease names are shortened.

    ``meter_provider`` / ``tracer_provider``: an OpenTelemetry SDK's providers; None (the
    default) uses the global ones, also when they are set after this object was made.
    ``name_pattern(name) -> str`` turns a lease name into the ``sa_fence.lease.pattern``
    attribute for leases not taken by ``@fenced`` (whose template is used): it must map the
    names to few values.  At most ``max_patterns`` distinct patterns are reported; the rest
    count as ``"other"``. ``root_spans``: False (the default) starts spans only inside a trace
    the caller started; True makes an acquire, release or commit outside any trace a trace of
    its own (metrics are recorded either way).  Pass it to :class:`sa_fence.Fencer` /
    :class:`sa_fence.AsyncFencer` (``telemetry=``).
    """

    #: False when the OpenTelemetry API is not installed (everything is a no-op then)
    enabled: bool
    # The instruments: OpenTelemetry API objects, or these no-ops without the API.
    tracer: Any = _NOOP
    acquires: Any = _NOOP
    renewals: Any = _NOOP
    lost: Any = _NOOP
    stale_refused: Any = _NOOP
    unfenced_refused: Any = _NOOP
    acquire_duration: Any = _NOOP
    hold_duration: Any = _NOOP
    first_write_delay: Any = _NOOP
    commit_check_duration: Any = _NOOP
    _untraced = True  # see start_span
    _proxy: Any = None

    def __init__(
        self,
        *,
        meter_provider: Any = None,
        tracer_provider: Any = None,
        name_pattern: Callable[[str], str] | None = None,
        max_patterns: int = 100,
        root_spans: bool = False,
    ) -> None:
        if not isinstance(root_spans, bool):
            raise TypeError(f"root_spans must be True or False, got {root_spans!r}")
        if name_pattern is not None and not callable(name_pattern):
            raise TypeError(f"name_pattern must be a callable str -> str, got {name_pattern!r}")
        if isinstance(max_patterns, bool) or not isinstance(max_patterns, int) or max_patterns < 1:
            raise ValueError(f"max_patterns must be a whole number >= 1, got {max_patterns!r}")
        for what, given in (("meter", meter_provider), ("tracer", tracer_provider)):
            if given is not None and not callable(getattr(given, f"get_{what}", None)):
                raise TypeError(f"{what}_provider must be an OpenTelemetry provider, got {given!r}")
        self.name_pattern = name_pattern or default_name_pattern
        self.max_patterns = max_patterns
        self.root_spans = root_spans
        self._patterns: set[str] = set()
        self._warned_other = False
        self._pattern_of = functools.lru_cache(maxsize=1024)(self._compute_pattern)
        self.enabled = otel_metrics is not None and otel_trace is not None
        if not self.enabled:
            return
        from . import __version__ as version

        self.tracer = tracer = otel_trace.get_tracer(SCOPE, version, tracer_provider)
        self._untraced = isinstance(tracer, otel_trace.NoOpTracer)
        # The API's proxy of the global provider: its _tracer property is what it
        # delegates to (an API without it is treated as any other tracer).
        proxied = isinstance(getattr(otel_trace.ProxyTracer, "_tracer", None), property)
        self._proxy = tracer if proxied and type(tracer) is otel_trace.ProxyTracer else None
        meter = otel_metrics.get_meter(SCOPE, version, meter_provider)
        state = _provider_state(meter_provider)  # counters' tallies, histograms' pending list
        for attr, (name, unit, description) in _COUNTERS.items():
            setattr(self, attr, state.counter(meter, name, unit, description))
        for attr, (name, description) in _HISTOGRAMS.items():
            setattr(self, attr, _Histogram(meter, name, description, state))

    def start_span(self, name: str, attributes: Mapping[str, Any]) -> Any:
        """A span named ``name``, child of the caller's; the no-op span outside a
        trace unless ``root_spans`` (why: docs/observability.md, "Spans")."""
        tracer = self.tracer
        if self._proxy is not None:
            # The global provider's tracer, or the API's no-op one while none is set: then
            # no span (8 calls less); asked every time: a provider set later takes effect.
            tracer = self._proxy._tracer
            if type(tracer) is otel_trace.NoOpTracer:
                return _NOOP
        elif self._untraced:
            return _NOOP
        if not (self.root_spans or otel_trace.get_current_span().get_span_context().is_valid):
            return _NOOP
        return tracer.start_span(name, attributes=attributes)

    def pattern(self, name: object) -> str:
        """The ``sa_fence.lease.pattern`` value for lease ``name``."""
        template = _template.get()
        if template is not None:
            return self._bounded(template)
        if not isinstance(name, str):
            return "invalid"
        return self._pattern_of(name)

    def _compute_pattern(self, name: str) -> str:
        try:
            pattern = self.name_pattern(name)
        except Exception:
            log.exception("name_pattern(%r) raised; the lease is reported as 'other'", name)
            return OTHER
        if not isinstance(pattern, str):
            return OTHER
        return self._bounded(pattern)

    def _bounded(self, pattern: str) -> str:
        patterns = self._patterns
        if pattern in patterns:
            return pattern
        if len(patterns) >= self.max_patterns:
            if not self._warned_other:
                self._warned_other = True
                log.warning(
                    "more than %d distinct lease name patterns: the rest are reported as "
                    "'other'. Give Telemetry(name_pattern=...) a function that maps lease "
                    "names to few values (e.g. their prefix).",
                    self.max_patterns,
                )
            return OTHER
        patterns.add(pattern)
        return pattern


_default: Telemetry | None = None


def default() -> Telemetry:
    """The Telemetry of fencers given none: the global OpenTelemetry providers."""
    global _default
    if _default is None:
        _default = Telemetry()
    return _default


def of(fencer: Any) -> Telemetry:
    return getattr(fencer, "_telemetry", None) or default()


class LeaseTelemetry:
    """What one granted lease reports under (kept on the lease as ``_tel``)."""

    __slots__ = ("attrs", "granted_at", "span", "telemetry", "wrote")

    def __init__(self, telemetry: Telemetry, pattern: str, granted_at: float) -> None:
        self.telemetry = telemetry
        self.attrs = {PATTERN: pattern}
        self.granted_at = granted_at  # time.monotonic()
        self.wrote = False
        self.span: Any = _NOOP  # the lease's span, acquire to release (_NOOP: none, or ended)


class Reported:
    """The lease core inherits this: only this module touches ``_tel``."""

    _tel: LeaseTelemetry | None = None  # what the lease reports its metrics under (set at acquire)


def _lease_tel(lease: LeaseView) -> LeaseTelemetry:
    tel: LeaseTelemetry | None = getattr(lease, "_tel", None)
    if tel is None:  # a lease made without acquire (tests' doubles)
        telemetry = of(lease.fencer)
        tel = LeaseTelemetry(telemetry, telemetry.pattern(lease.name), lease.acquired_at)
        lease._tel = tel
    return tel


def log_extra(lease: Any, outcome: str | None = None) -> dict[str, Any]:
    """The ``extra`` fields of a log record about ``lease`` (never its owner)."""
    tel = getattr(lease, "_tel", None)
    extra: dict[str, Any] = {
        "sa_fence_lease": getattr(lease, "name", None),
        "sa_fence_pattern": tel.attrs[PATTERN] if tel is not None else None,
        "sa_fence_token": getattr(lease, "token", None),
    }
    if outcome is not None:
        extra["sa_fence_outcome"] = outcome
    return extra


def _error_status(span: Any, exc: BaseException) -> None:
    if otel_trace is not None and span is not _NOOP:
        span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, type(exc).__name__))
        span.record_exception(exc)


def _traced(
    start: Callable[..., Any], done: Callable[[Any, Any], None], failed: Callable[..., None]
) -> Callable[[F], F]:
    """A decorator of a method, sync or async: ``probe = start(self, args, kwargs)`` before
    the call, then ``done(probe, result)`` or ``failed(probe, exc)``."""

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def traced_async(self: Any, *args: Any, **kwargs: Any) -> Any:
                probe = start(self, args, kwargs)
                try:
                    result = await fn(self, *args, **kwargs)
                except BaseException as exc:
                    failed(probe, exc)
                    raise
                done(probe, result)
                return result

            return traced_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            probe = start(self, args, kwargs)
            try:
                result = fn(self, *args, **kwargs)
            except BaseException as exc:
                failed(probe, exc)
                raise
            done(probe, result)
            return result

        return traced  # type: ignore[return-value]

    return decorate


class _Acquiring:
    """One acquire being measured: its span and start time."""

    __slots__ = ("name", "pattern", "span", "started", "telemetry")

    def __init__(self, fencer: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        self.telemetry = telemetry = of(fencer)
        self.name = args[0] if args else kwargs.get("name")
        self.pattern = pattern = telemetry.pattern(self.name)
        self.span = telemetry.start_span("sa_fence.lease", {PATTERN: pattern})
        self.started = time.perf_counter()

    def granted(self, lease: LeaseView) -> None:
        telemetry, took = self.telemetry, time.perf_counter() - self.started
        lease._tel = tel = LeaseTelemetry(telemetry, self.pattern, lease.acquired_at)
        attrs = {PATTERN: self.pattern, OUTCOME: "granted"}
        telemetry.acquires.add(1, attrs)
        telemetry.acquire_duration.record(took, attrs)
        span = self.span
        if span is not _NOOP:  # it stays open until the release
            # attributes, not a "granted" event: an event costs ~5 us more per lease
            span.set_attributes({OUTCOME: "granted", TOKEN: lease.token, ACQUIRE_SECONDS: took})
            tel.span = span
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "lease %r granted with token %d in %.1f ms",
                lease.name,
                lease.token,
                took * 1000,
                extra=log_extra(lease, "granted"),
            )

    def failed(self, exc: BaseException) -> None:
        telemetry, took = self.telemetry, time.perf_counter() - self.started
        outcome = next((o for kind, o in _OUTCOMES if isinstance(exc, kind)), "error")
        if outcome == "error" and type(exc).__name__ == "CancelledError":
            outcome = "cancelled"
        span = self.span
        if outcome is not None:
            attrs = {PATTERN: self.pattern, OUTCOME: outcome}
            telemetry.acquires.add(1, attrs)
            telemetry.acquire_duration.record(took, attrs)
            span.set_attribute(OUTCOME, outcome)
        if outcome != "busy":  # contention is an answer, not an error
            if outcome is not None:
                fields = {"sa_fence_lease": self.name, "sa_fence_pattern": self.pattern}
                log.debug(
                    "acquire of lease %r failed (%s): %s",
                    self.name,
                    outcome,
                    type(exc).__name__,
                    extra={**fields, "sa_fence_outcome": outcome},
                )
            _error_status(span, exc)
        span.end()


def _releasing(lease: Any, args: Any, kwargs: Any) -> LeaseTelemetry:
    return lease._tel or _lease_tel(lease)  # (a LeaseTelemetry is never false)


def _release_ended(tel: LeaseTelemetry, result: Any = None) -> None:
    span, tel.span = tel.span, _NOOP  # taken off the lease: ended once
    span.end()


def _release_failed(tel: LeaseTelemetry, exc: BaseException) -> None:
    _error_status(tel.span, exc)
    _release_ended(tel)


#: ``Fencer.acquire`` / ``AsyncFencer.acquire``, measured: outcome, latency, the lease's span.
traced_acquire = traced_acquire_async = _traced(_Acquiring, _Acquiring.granted, _Acquiring.failed)
#: ``Lease.release`` / ``AsyncLease.release``: ending the lease's span (``released``: hold time).
traced_release = traced_release_async = _traced(_releasing, _release_ended, _release_failed)


def released(lease: LeaseView, deleted: bool) -> None:
    """A release answered: record how long the lease was held."""
    tel = _lease_tel(lease)
    outcome = "released" if deleted else "expired"
    held = time.monotonic() - tel.granted_at
    tel.telemetry.hold_duration.record(held, {**tel.attrs, OUTCOME: outcome})
    tel.span.set_attribute(RELEASE, outcome)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "lease %r (token %d) %s after %.3f s",
            lease.name,
            lease.token,
            outcome,
            held,
            extra=log_extra(lease, outcome),
        )


def renewal(lease: LeaseView, outcome: str, sent_at: float) -> None:
    """A background renewal answered (``"extended"``) or not (anything else)."""
    tel = _lease_tel(lease)
    result = "ok" if outcome == "extended" else "failed"
    tel.telemetry.renewals.add(1, {**tel.attrs, OUTCOME: result})
    span = tel.span
    if span is not _NOOP and span.is_recording():  # an event of the lease's span
        sent_ns = time.time_ns() - int(max(0.0, time.monotonic() - sent_at) * 1e9)
        span.add_event("sa_fence.renew", {OUTCOME: result}, timestamp=sent_ns)


def lost(lease: LeaseView) -> None:
    """The lease was found lost (once per lease)."""
    tel = _lease_tel(lease)
    tel.telemetry.lost.add(1, tel.attrs)
    if tel.span is not _NOOP:
        tel.span.add_event("sa_fence.lost")


def wrote(lease: LeaseView) -> None:
    """A write statement is about to run under ``lease``: the first one is timed."""
    tel = lease._tel or _lease_tel(lease)  # (a LeaseTelemetry is never false)
    if tel.wrote:
        return
    tel.wrote = True
    tel.telemetry.first_write_delay.record(time.monotonic() - tel.granted_at, tel.attrs)


def stale_refused(lease: LeaseView | None, check: str, error: BaseException) -> None:
    """A stale write was refused at ``check`` (LEASE_SCOPE, ROW_FENCE, GUARD)."""
    if lease is not None:
        tel = _lease_tel(lease)
        telemetry, attrs = tel.telemetry, {**tel.attrs, CHECK: check}
    else:
        telemetry, attrs = default(), {CHECK: check}
    telemetry.stale_refused.add(1, attrs)
    log.info(
        "stale write refused (%s) under lease %r (token %s): a newer lease of the name was granted",
        check,
        getattr(lease, "name", getattr(error, "lease_name", None)),
        getattr(lease, "token", getattr(error, "token", None)),
        extra=log_extra(lease, check) if lease is not None else None,
    )


def unfenced_refused(check: str = "flush") -> None:
    """A write of fenced rows without a lease was refused (UnfencedWriteError)."""
    default().unfenced_refused.add(1, {CHECK: check})


class CommitCheck:
    """The commit check of one transaction (``with commit_check(scope):``): span and latency."""

    __slots__ = ("scope", "span", "started", "tel")

    def __init__(self, scope: Mapping[tuple[str, int], LeaseView], tel: Any, span: Any) -> None:
        self.scope, self.tel, self.span = scope, tel, span
        self.started = time.perf_counter()

    def __enter__(self) -> CommitCheck:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        took = time.perf_counter() - self.started
        if exc is None:
            outcome = "ok"
        elif isinstance(exc, errors.StaleTokenError):
            outcome = "stale"
            commit_refused(self.scope, exc)
        else:
            outcome = "error"
        tel, span = self.tel, self.span
        tel.telemetry.commit_check_duration.record(took, {**tel.attrs, OUTCOME: outcome})
        if exc is not None:
            span.set_attribute(OUTCOME, outcome)
            _error_status(span, exc)
        span.end()


def commit_check(scope: Mapping[tuple[str, int], LeaseView]) -> CommitCheck | None:
    """The commit check's span and latency, or None when neither would be recorded (no
    provider, or no API; ~15 calls less): then :func:`commit_refused` counts a refusal."""
    for lease in scope.values():  # noqa: B007 (the first one: no next(iter()) calls)
        break
    tel = lease._tel or _lease_tel(lease)  # (a LeaseTelemetry is never false)
    telemetry, proxy = tel.telemetry, tel.telemetry._proxy  # (start_span's no-span cases:)
    no_span = telemetry._untraced if proxy is None else type(proxy._tracer) is otel_trace.NoOpTracer
    span = _NOOP if no_span else telemetry.start_span("sa_fence.commit_check", tel.attrs)
    histogram = telemetry.commit_check_duration  # idle: _NOOP, or the API's proxy of none
    if span is _NOOP and (
        histogram is _NOOP or (histogram.proxy and histogram.histogram._real_instrument is None)
    ):
        return None
    return CommitCheck(scope, tel, span)


def commit_refused(scope: Mapping[tuple[str, int], LeaseView], exc: errors.StaleTokenError) -> None:
    """Lease scope refused a COMMIT: count it under the lease found stale."""
    named = [lease for (name, _), lease in scope.items() if name == exc.lease_name]
    stale_refused(named[0] if named else next(iter(scope.values())), LEASE_SCOPE, exc)


def flush_started(lease: LeaseView) -> Any:
    """A fenced flush begins: its span (ended by :func:`flush_ended`), or None."""
    tel = lease._tel or _lease_tel(lease)  # (a LeaseTelemetry is never false)
    telemetry, proxy = tel.telemetry, tel.telemetry._proxy  # (start_span's no-span cases:)
    if telemetry._untraced if proxy is None else type(proxy._tracer) is otel_trace.NoOpTracer:
        return None
    span = telemetry.start_span("sa_fence.flush", tel.attrs)
    return None if span is _NOOP else span


def flush_ended(span: Any, *, failed: bool = False) -> None:
    """The fenced flush ended (``failed``: it was rolled back)."""
    if failed and otel_trace is not None and span is not _NOOP:
        span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, "flush failed"))
    span.end()
