"""Metrics, spans and log records: each signal moves when its event happens.

Real servers; the OpenTelemetry SDK's in-memory reader and exporter receive
what sa-fence reports.  Each test gets its own providers (a Telemetry given
to the Fencer, and the same one as the default for what has no Fencer, such
as an unfenced write), restored afterwards.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence import telemetry as _telemetry
from sa_fence.lease import lifecycle
from sa_fence.testing import expire
from tests._tools import wait_for
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE, Audit, Job

PATTERN = "sa_fence.lease.pattern"
OUTCOME = "sa_fence.outcome"


@dataclass
class Otel:
    reader: InMemoryMetricReader
    spans: InMemorySpanExporter
    telemetry: sa_fence.telemetry.Telemetry
    tracer: Any
    provider: Any = None
    meters: Any = None

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def count(self, name: str, **attrs: str) -> float:
        """A counter's value (or a histogram's count) over points matching ``attrs``."""
        total = 0.0
        for p in self.points(name):
            if all(p.attributes.get(k) == v for k, v in _keys(attrs).items()):
                total += p.value if hasattr(p, "value") else p.count
        return total

    def finished(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == name]


def _keys(attrs: dict[str, str]) -> dict[str, str]:
    names = {"pattern": PATTERN, "outcome": OUTCOME, "check": "sa_fence.check"}
    return {names[k]: v for k, v in attrs.items()}


@pytest.fixture
def otel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Otel]:
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = sa_fence.telemetry.Telemetry(meter_provider=meters, tracer_provider=tracers)
    monkeypatch.setattr(_telemetry, "_default", telemetry)  # restored after the test
    yield Otel(reader, exporter, telemetry, tracers.get_tracer("test"), tracers, meters)
    meters.shutdown()
    tracers.shutdown()


@pytest.fixture
def tfencer(
    otel: Otel, redis_client: redis.Redis, engine: sa.Engine, key_prefix: str
) -> sa_fence.Fencer:
    return sa_fence.Fencer(
        redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix, telemetry=otel.telemetry
    )


MakeFencer = Callable[..., tuple[sa_fence.Fencer, list[Otel]]]


@pytest.fixture
def reading(redis_client: redis.Redis, engine: sa.Engine, key_prefix: str) -> Iterator[MakeFencer]:
    """``reading(*readers)``: a fencer reporting to a MeterProvider of its own
    with these readers, and one Otel per reader; the providers are shut down
    after the test."""
    providers: list[MeterProvider] = []

    def make(*readers: InMemoryMetricReader) -> tuple[sa_fence.Fencer, list[Otel]]:
        meters = MeterProvider(metric_readers=list(readers))
        providers.append(meters)
        telemetry = sa_fence.telemetry.Telemetry(meter_provider=meters)
        fencer = sa_fence.Fencer(
            redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix, telemetry=telemetry
        )
        return fencer, [
            Otel(r, InMemorySpanExporter(), telemetry, None, meters=meters) for r in readers
        ]

    yield make
    for meters in providers:
        meters.shutdown()


def _job(make_session: sessionmaker[Session], lease: sa_fence.Lease, job_id: int) -> None:
    with make_session() as session:
        lease.bind(session)
        session.add(Job(id=job_id, result="new"))
        session.commit()


# ------------------------------------------------------------------ acquire


def test_a_granted_lease_is_counted_timed_and_one_span_from_acquire_to_release(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    with otel.tracer.start_as_current_span("caller") as caller:
        started = time.time_ns()
        lease = tfencer.acquire("job:17", ttl=5)
        granted = time.time_ns()
        assert otel.finished("sa_fence.lease") == []  # open while the lease is held
        time.sleep(0.05)
        released = time.time_ns()
        lease.release()
    assert otel.count("sa_fence.lease.acquires", pattern="job:{n}", outcome="granted") == 1
    assert otel.count("sa_fence.lease.acquire.duration", outcome="granted") == 1
    (span,) = otel.spans.get_finished_spans()[:-1]  # the last one is the caller's
    assert span.name == "sa_fence.lease"
    assert span.parent is not None
    assert span.parent.span_id == caller.get_span_context().span_id
    assert span.attributes is not None
    assert span.attributes[PATTERN] == "job:{n}"
    assert span.attributes["sa_fence.token"] == lease.token
    assert span.attributes[OUTCOME] == "granted"
    assert span.attributes["sa_fence.release"] == "released"
    assert 0 < span.attributes["sa_fence.acquire.duration"] <= (granted - started) / 1e9
    assert span.start_time is not None
    assert span.end_time is not None
    assert started <= span.start_time <= granted
    assert span.end_time >= released
    assert span.status.is_unset


def test_a_second_release_ends_nothing_more(
    otel: Otel, tfencer: sa_fence.Fencer, caplog: pytest.LogCaptureFixture
) -> None:
    with otel.tracer.start_as_current_span("caller"):
        lease = tfencer.acquire("job:1", ttl=5)
        assert lease.release()
        with caplog.at_level(logging.WARNING, logger="opentelemetry"):
            assert not lease.release()
    assert len(otel.finished("sa_fence.lease")) == 1
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]


def test_a_busy_lease_counts_as_busy_and_its_span_is_not_an_error(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    with (
        otel.tracer.start_as_current_span("caller"),
        tfencer.acquire("job:1", ttl=5),
        pytest.raises(sa_fence.LeaseNotAcquiredError),
    ):
        tfencer.acquire("job:1", ttl=5)
    assert otel.count("sa_fence.lease.acquires", outcome="busy") == 1
    busy = [s for s in otel.finished("sa_fence.lease") if s.attributes[OUTCOME] == "busy"]
    assert len(busy) == 1
    assert busy[0].status.is_ok


def test_redis_down_counts_as_backend_error(otel: Otel, engine: sa.Engine, key_prefix: str) -> None:
    down = redis.Redis(port=1, socket_timeout=0.2, socket_connect_timeout=0.2)
    fencer = sa_fence.Fencer(
        down, engine, sequence=SEQUENCE, key_prefix=key_prefix, telemetry=otel.telemetry
    )
    with otel.tracer.start_as_current_span("caller"), pytest.raises(sa_fence.LeaseBackendError):
        fencer.acquire("job:1", ttl=5)
    assert otel.count("sa_fence.lease.acquires", outcome="backend_error") == 1
    (span,) = otel.finished("sa_fence.lease")
    assert not span.status.is_ok


def test_a_missing_sequence_counts_as_setup_error(
    otel: Otel, redis_client: redis.Redis, engine: sa.Engine, key_prefix: str
) -> None:
    fencer = sa_fence.Fencer(
        redis_client,
        engine,
        sequence="no_such_seq",
        key_prefix=key_prefix,
        telemetry=otel.telemetry,
    )
    with pytest.raises(sa_fence.FencingConfigError):
        fencer.acquire("job:1", ttl=5)
    assert otel.count("sa_fence.lease.acquires", outcome="setup_error") == 1


def test_a_bad_argument_is_not_counted_as_an_acquire(otel: Otel, tfencer: sa_fence.Fencer) -> None:
    with pytest.raises(ValueError, match="ttl"):
        tfencer.acquire("job:1", ttl=-1)
    assert otel.count("sa_fence.lease.acquires") == 0


# ------------------------------------------------- renewal, loss, release


def test_background_renewals_are_counted_ok_and_are_events_of_the_lease_span(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    with otel.tracer.start_as_current_span("caller"), tfencer.acquire("job:1", ttl=0.3, renew=True):
        wait_for(lambda: otel.count("sa_fence.lease.renewals", outcome="ok"), 5, "a renewal")
    renewals = otel.count("sa_fence.lease.renewals", outcome="ok")
    assert renewals >= 1
    (span,) = otel.finished("sa_fence.lease")
    events = [e for e in span.events if e.name == "sa_fence.renew"]
    assert len(events) == renewals
    assert all(e.attributes is not None and e.attributes[OUTCOME] == "ok" for e in events)
    assert span.start_time is not None
    assert span.end_time is not None
    assert all(span.start_time <= e.timestamp <= span.end_time for e in events)
    assert [s.name for s in otel.spans.get_finished_spans()] == ["sa_fence.lease", "caller"]


def test_renewals_of_a_lease_acquired_outside_any_trace_are_counted_not_traced(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    with tfencer.acquire("job:1", ttl=0.3, renew=True):
        wait_for(lambda: otel.count("sa_fence.lease.renewals", outcome="ok"), 5, "a renewal")
    assert otel.count("sa_fence.lease.renewals", outcome="ok") >= 1
    assert otel.spans.get_finished_spans() == ()


def test_a_renewal_that_finds_the_lease_gone_counts_failed_and_lost(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    with otel.tracer.start_as_current_span("caller"):
        lease = tfencer.acquire("job:1", ttl=0.3, renew=True)
    expire(lease)
    wait_for(lambda: lease.lost, 5, "the renewal to find the lease gone")
    lease.release()
    assert otel.count("sa_fence.lease.renewals", outcome="failed") == 1
    assert otel.count("sa_fence.lease.lost", pattern="job:{n}") == 1
    (span,) = otel.finished("sa_fence.lease")
    names = [e.name for e in span.events]
    assert names[-2:] == ["sa_fence.renew", "sa_fence.lost"]
    assert span.events[-2].attributes == {OUTCOME: "failed"}
    assert span.attributes is not None
    assert span.attributes["sa_fence.release"] == "expired"


def test_a_renewal_answered_after_the_release_is_not_counted(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    """The lease is released while its renewal's EXTEND is in flight (the seam releases it
    inside the call): the answer, "not ours", is ignored, and counts as no failed renewal."""
    lease = tfencer.acquire("job:1", ttl=5, renew=True)
    extend = tfencer._extend

    def released_meanwhile(*, keys: list[str], args: list[Any]) -> Any:
        lease.release()
        return extend(keys=keys, args=args)

    tfencer._extend = released_meanwhile  # type: ignore[method-assign]
    try:
        assert lifecycle.renew(lease) is None
    finally:
        tfencer._extend = extend  # type: ignore[method-assign]
    assert otel.count("sa_fence.lease.renewals") == 0
    assert otel.count("sa_fence.lease.hold.duration", outcome="released") == 1


def test_release_records_the_hold_time_as_released_or_expired(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    with otel.tracer.start_as_current_span("caller"):
        with tfencer.acquire("job:1", ttl=5):
            time.sleep(0.05)
        lease = tfencer.acquire("job:2", ttl=5)
        expire(lease)
        lease.release()
    (released,) = [
        p
        for p in otel.points("sa_fence.lease.hold.duration")
        if p.attributes[OUTCOME] == "released"
    ]
    assert released.count == 1
    assert released.sum >= 0.05
    assert otel.count("sa_fence.lease.hold.duration", outcome="expired") == 1
    spans = otel.finished("sa_fence.lease")
    assert [s.attributes["sa_fence.release"] for s in spans] == ["released", "expired"]  # type: ignore[index]


# ------------------------------------------------------------ writes


def test_the_first_write_after_the_grant_is_timed_once(
    otel: Otel, tfencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    with tfencer.acquire("job:1", ttl=5) as lease:
        time.sleep(0.02)
        _job(make_session, lease, 1)
        with make_session() as session:
            lease.bind(session)
            session.add(Audit(message="again"))
            session.commit()
    (point,) = otel.points("sa_fence.lease.first_write.delay")
    assert point.count == 1
    assert point.sum >= 0.02


def test_a_fenced_flush_and_its_commit_check_are_traced_and_timed(
    otel: Otel, tfencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    with (
        tfencer.acquire("job:1", ttl=5) as lease,
        otel.tracer.start_as_current_span("caller") as caller,
    ):
        _job(make_session, lease, 1)
    (flush,) = otel.finished("sa_fence.flush")
    (check,) = otel.finished("sa_fence.commit_check")
    caller_id = caller.get_span_context().span_id
    assert flush.parent is not None
    assert flush.parent.span_id == caller_id
    assert check.parent is not None
    assert check.parent.span_id == caller_id
    assert flush.status.is_ok
    assert otel.count("sa_fence.commit_check.duration", outcome="ok") == 1


#: How a bound session's transaction is ended: by SQLAlchemy, or as SQL the caller sends.
COMMITS: dict[str, Callable[[Session], object]] = {
    "session.commit()": Session.commit,
    "COMMIT as SQL": lambda session: session.execute(sa.text("COMMIT")),
    "PREPARE TRANSACTION as SQL": lambda s: s.execute(sa.text("PREPARE TRANSACTION 'sa_fence'")),
}


@pytest.mark.parametrize("commit", list(COMMITS))
def test_a_stale_commit_is_counted_as_refused_by_lease_scope(
    otel: Otel, tfencer: sa_fence.Fencer, make_session: sessionmaker[Session], commit: str
) -> None:
    """However the transaction ends, lease scope's refusal counts as lease scope's, never as a
    guard's (no guard trigger is involved); the commit sa-fence sends is also timed and
    traced."""
    old = tfencer.acquire("job:1", ttl=5)
    with make_session() as session:
        old.bind(session)
        session.add(Audit(message="late"))
        session.flush()
        expire(old)
        with (
            otel.tracer.start_as_current_span("caller"),
            tfencer.acquire("job:1", ttl=5),
            pytest.raises(sa_fence.StaleTokenError),
        ):
            COMMITS[commit](session)
    assert otel.count("sa_fence.write.stale_refused", check="lease_scope", pattern="job:{n}") == 1
    assert otel.count("sa_fence.write.stale_refused", check="guard", pattern="job:{n}") == 0
    if commit == "session.commit()":
        assert otel.count("sa_fence.commit_check.duration", outcome="stale") == 1
        (check,) = otel.finished("sa_fence.commit_check")
        assert not check.status.is_ok


def test_a_stale_commit_sent_as_sql_counts_under_the_lease_found_stale(
    otel: Otel, tfencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    """A transaction in scope for two leases (rebound midway, as a nested @fenced does): the
    refusal counts under the one the register found stale, not the one bound last."""
    alpha, beta = tfencer.acquire("alpha:1", ttl=5), tfencer.acquire("beta:1", ttl=5)
    with make_session() as session:
        for lease in (alpha, beta):
            lease.bind(session)
            session.add(Audit(message=lease.name))
            session.flush()
        expire(alpha)
        with (
            tfencer.acquire("alpha:1", ttl=5),
            pytest.raises(sa_fence.StaleTokenError) as refused,
        ):
            session.execute(sa.text("COMMIT"))
    beta.release()
    assert refused.value.lease_name == "alpha:1"
    assert otel.count("sa_fence.write.stale_refused", check="lease_scope", pattern="alpha:{n}") == 1
    assert otel.count("sa_fence.write.stale_refused", pattern="beta:{n}") == 0


def test_a_fenced_connection_refused_at_a_commit_sent_as_sql_times_no_ok_commit_after(
    otel: Otel, tfencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    """The server ended the refused transaction: the Connection's next commit has nothing to
    check, and records no commit check as passed."""
    old = tfencer.acquire("job:1", ttl=5)
    with engine.connect() as conn, sa_fence.fence_connection(conn, old):
        conn.execute(sa.insert(Audit).values(message="late"))
        expire(old)
        with tfencer.acquire("job:1", ttl=5), pytest.raises(sa_fence.StaleTokenError):
            conn.execute(sa.text("COMMIT"))
        conn.commit()
    assert otel.count("sa_fence.commit_check.duration", outcome="ok") == 0
    assert otel.count("sa_fence.write.stale_refused", check="lease_scope") == 1
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).where(Audit.message == "late")) == 0


def test_a_stale_row_write_is_counted_as_refused_by_the_row_fence(
    otel: Otel, tfencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    old = tfencer.acquire("job:1", ttl=5)
    expire(old)
    with tfencer.acquire("job:1", ttl=5) as new:
        _job(make_session, new, 1)
    with make_session() as session:
        old.bind(session)
        job = session.get(Job, 1)
        assert job is not None
        job.result = "stale"
        with otel.tracer.start_as_current_span("caller"), pytest.raises(sa_fence.StaleTokenError):
            session.flush()
    assert otel.count("sa_fence.write.stale_refused", check="row_fence") == 1
    failed = [s for s in otel.finished("sa_fence.flush") if not s.status.is_ok]
    assert len(failed) == 1


def test_an_unfenced_write_is_counted_as_refused(
    otel: Otel, make_session: sessionmaker[Session]
) -> None:
    with make_session() as session:
        session.add(Job(id=1, result="x"))
        with pytest.raises(sa_fence.UnfencedWriteError):
            session.flush()
    assert otel.count("sa_fence.write.unfenced_refused", check="flush") == 1


# ------------------------------------------------- outside any trace


def test_outside_any_trace_nothing_is_traced_and_everything_is_counted(
    otel: Otel, tfencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    with tfencer.acquire("job:1", ttl=5) as lease:
        _job(make_session, lease, 1)
    assert otel.spans.get_finished_spans() == ()
    assert otel.count("sa_fence.lease.acquires", outcome="granted") == 1
    assert otel.count("sa_fence.lease.hold.duration", outcome="released") == 1
    assert otel.count("sa_fence.commit_check.duration", outcome="ok") == 1


def test_root_spans_trace_each_operation_outside_any_trace(
    otel: Otel,
    redis_client: redis.Redis,
    engine: sa.Engine,
    key_prefix: str,
    make_session: sessionmaker[Session],
) -> None:
    telemetry = sa_fence.telemetry.Telemetry(tracer_provider=otel.provider, root_spans=True)
    fencer = sa_fence.Fencer(
        redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix, telemetry=telemetry
    )
    with fencer.acquire("job:1", ttl=5) as lease:
        _job(make_session, lease, 1)
    names = sorted(s.name for s in otel.spans.get_finished_spans())
    assert names == ["sa_fence.commit_check", "sa_fence.flush", "sa_fence.lease"]
    assert all(s.parent is None for s in otel.spans.get_finished_spans())


def test_root_spans_must_be_a_bool_and_providers_providers() -> None:
    with pytest.raises(TypeError, match="root_spans must be True or False"):
        sa_fence.telemetry.Telemetry(root_spans="yes")  # type: ignore[arg-type]
    for given in ({"meter_provider": "junk"}, {"tracer_provider": 42}):
        with pytest.raises(TypeError, match="_provider must be an OpenTelemetry provider"):
            sa_fence.telemetry.Telemetry(**given)  # type: ignore[arg-type]
    sa_fence.telemetry.Telemetry(meter_provider=MeterProvider(), tracer_provider=TracerProvider())


def test_counters_report_per_interval_to_a_delta_reader(reading: MakeFencer) -> None:
    """The counters are observable (cumulative totals kept in the process); a
    reader asking for delta temporality still gets what happened since its last
    collection, as from a synchronous counter."""
    from opentelemetry.sdk.metrics import ObservableCounter
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    fencer, (otel,) = reading(
        InMemoryMetricReader(
            preferred_temporality={ObservableCounter: AggregationTemporality.DELTA}
        )
    )
    for _ in range(2):
        fencer.acquire("job:1", ttl=5).release()
    assert otel.count("sa_fence.lease.acquires", outcome="granted") == 2
    fencer.acquire("job:1", ttl=5).release()
    assert otel.count("sa_fence.lease.acquires", outcome="granted") == 1


def test_two_telemetries_on_one_meter_provider_both_count(
    redis_client: redis.Redis, engine: sa.Engine, key_prefix: str
) -> None:
    """A provider keeps the first observable counter of a name: the second
    Telemetry (another name_pattern, say) shares its totals instead of losing them."""
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    try:
        fencers = [
            sa_fence.Fencer(
                redis_client,
                engine,
                sequence=SEQUENCE,
                key_prefix=key_prefix,
                telemetry=sa_fence.telemetry.Telemetry(meter_provider=meters, name_pattern=pattern),
            )
            for pattern in (lambda name: "first", lambda name: "second")
        ]
        for n, fencer in enumerate(fencers):
            fencer.acquire(f"job:{n}", ttl=5).release()
        otel = Otel(reader, InMemorySpanExporter(), fencers[0]._telemetry, None)  # type: ignore[arg-type]
        assert otel.count("sa_fence.lease.acquires", pattern="first") == 1
        assert otel.count("sa_fence.lease.acquires", pattern="second") == 1
    finally:
        meters.shutdown()


# -------------------------------------------- histograms recorded at collection


def _histogram(otel: Otel, name: str) -> Any:
    (point,) = otel.points(name)
    return point


def test_histograms_outside_a_trace_reach_the_next_collection_with_their_values(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    """Outside a sampled trace a histogram measurement waits in the process and
    is recorded when a reader collects: the same count, sum and buckets."""
    lease = tfencer.acquire("job:1", ttl=5)
    time.sleep(0.3)
    lease.release()
    held = _histogram(otel, "sa_fence.lease.hold.duration")
    assert held.count == 1
    assert 0.3 <= held.sum < 5
    assert held.explicit_bounds == _telemetry.BUCKETS
    assert sum(held.bucket_counts) == 1
    assert _histogram(otel, "sa_fence.lease.acquire.duration").count == 1
    tfencer.acquire("job:1", ttl=5).release()
    assert _histogram(otel, "sa_fence.lease.hold.duration").count == 2  # cumulative


def test_an_api_without_bucket_advice_gets_the_sdks_default_buckets_and_no_error(
    redis_client: redis.Redis, engine: sa.Engine, key_prefix: str
) -> None:
    """OpenTelemetry's API before 1.30 (brought in by another package: sa-fence does not depend
    on it) has no ``explicit_bucket_boundaries_advisory``: sa-fence's histograms get the SDK's
    default buckets there, where passing the advice raised TypeError at every Fencer."""
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])

    class OldMeter:  # create_histogram as the API had it before 1.30
        def __init__(self, meter: Any) -> None:
            self.meter = meter

        def create_histogram(self, name: str, unit: str = "", description: str = "") -> Any:
            return self.meter.create_histogram(name, unit=unit, description=description)

        def __getattr__(self, attr: str) -> Any:
            return getattr(self.meter, attr)

    class OldMeters:
        def get_meter(self, *args: Any, **kwargs: Any) -> OldMeter:
            return OldMeter(meters.get_meter(*args, **kwargs))

    try:
        telemetry = sa_fence.telemetry.Telemetry(meter_provider=OldMeters())
        fencer = sa_fence.Fencer(
            redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix, telemetry=telemetry
        )
        fencer.acquire("job:1", ttl=5).release()
        otel = Otel(reader, InMemorySpanExporter(), telemetry, None)
        held = _histogram(otel, "sa_fence.lease.hold.duration")
        assert held.count == 1
        assert held.explicit_bounds != _telemetry.BUCKETS  # the SDK's own
    finally:
        meters.shutdown()


def test_inside_a_sampled_span_a_histogram_keeps_its_exemplar(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    """Recorded at collection with the context it was made in, so the SDK's
    default (trace-based) exemplar filter links the sample to that trace; one
    made outside any trace has none."""
    with otel.tracer.start_as_current_span("caller") as caller:
        tfencer.acquire("job:1", ttl=5).release()
    pending = _telemetry._providers[otel.meters].pending
    assert len(pending) == 2  # acquire and hold duration: not recorded yet
    point = _histogram(otel, "sa_fence.lease.acquire.duration")
    assert [e.trace_id for e in point.exemplars] == [caller.get_span_context().trace_id]
    assert [e.value for e in point.exemplars] == [point.sum]
    tfencer.acquire("job:2", ttl=5).release()
    point = _histogram(otel, "sa_fence.lease.acquire.duration")
    assert point.count == 2
    assert list(point.exemplars) == []  # this collection's one sample was made in no trace


def test_histograms_report_per_interval_to_a_delta_reader(reading: MakeFencer) -> None:
    """Pending measurements land in the collection after which they happened."""
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    fencer, (otel,) = reading(
        InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    )
    for _ in range(2):
        fencer.acquire("job:1", ttl=5).release()
    assert _histogram(otel, "sa_fence.lease.hold.duration").count == 2
    assert otel.points("sa_fence.lease.hold.duration") == []  # nothing since
    fencer.acquire("job:1", ttl=5).release()
    assert _histogram(otel, "sa_fence.lease.hold.duration").count == 1


def test_every_reader_of_a_provider_gets_every_histogram_measurement(
    reading: MakeFencer,
) -> None:
    """The first collection records what is pending for every reader: the
    second reader, collecting later, misses nothing and counts nothing twice."""
    fencer, (a, b) = reading(InMemoryMetricReader(), InMemoryMetricReader())
    fencer.acquire("job:1", ttl=5).release()
    assert _histogram(a, "sa_fence.lease.hold.duration").count == 1
    fencer.acquire("job:1", ttl=5).release()
    assert _histogram(b, "sa_fence.lease.hold.duration").count == 2
    assert _histogram(a, "sa_fence.lease.hold.duration").count == 2


def test_pending_measurements_are_bounded_when_no_reader_collects(
    reading: MakeFencer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past PENDING_LIMIT measurements the thread adding one records them all:
    memory stays bounded with a reader that never collects, and nothing is lost."""
    monkeypatch.setattr(_telemetry, "PENDING_LIMIT", 8)
    fencer, (otel,) = reading(InMemoryMetricReader())
    pending = _telemetry._providers[otel.meters].pending
    longest = 0
    for _ in range(20):  # 40 measurements
        fencer.acquire("job:1", ttl=5).release()
        longest = max(longest, len(pending))
    assert longest < 8
    assert _histogram(otel, "sa_fence.lease.hold.duration").count == 20
    assert _histogram(otel, "sa_fence.lease.acquire.duration").count == 20


def test_pending_measurements_do_not_keep_a_dropped_provider_alive() -> None:
    """What sa-fence keeps per provider is weakly keyed: an application that
    replaces its MeterProvider does not leak the old one through pending values."""
    import gc
    import weakref

    def dropped() -> weakref.ref[MeterProvider]:
        meters = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
        telemetry = sa_fence.telemetry.Telemetry(meter_provider=meters)
        for _ in range(3):
            telemetry.hold_duration.record(0.1, {PATTERN: "job:{n}"})
        assert len(_telemetry._providers[meters].pending) == 3
        return weakref.ref(meters)

    ref = dropped()
    gc.collect()
    assert ref() is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_drops_its_parents_pending_measurements(
    otel: Otel, tfencer: sa_fence.Fencer
) -> None:
    """The parent reports what it measured; a child reporting it too would count it twice."""
    tfencer.acquire("job:1", ttl=5).release()
    pending = _telemetry._providers[otel.meters].pending
    assert len(pending) == 2
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, no test machinery
        os._exit(len(pending))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(pending) == 2  # the parent's are still there
    assert _histogram(otel, "sa_fence.lease.hold.duration").count == 1


# ------------------------------------------------------------ patterns


def test_the_decorators_template_is_the_pattern(
    otel: Otel, tfencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    @sa_fence.fenced("job:{job_id}", ttl=5, fencer=tfencer, session=make_session)
    def finish(job_id: int) -> None:
        sa_fence.current_session().add(Job(id=job_id, result="done"))

    finish(7)
    assert otel.count("sa_fence.lease.acquires", pattern="job:{job_id}", outcome="granted") == 1
    assert otel.count("sa_fence.lease.hold.duration", pattern="job:{job_id}") == 1
    assert otel.count("sa_fence.commit_check.duration", pattern="job:{job_id}") == 1


def test_default_pattern_replaces_numbers_uuids_and_long_hex() -> None:
    assert sa_fence.telemetry.default_name_pattern("job:42") == "job:{n}"
    assert (
        sa_fence.telemetry.default_name_pattern("run:1b4e28ba-2fa1-11d2-883f-0016d3cca427:step:3")
        == "run:{id}:step:{n}"
    )
    assert sa_fence.telemetry.default_name_pattern("blob:deadbeefcafe0123456789") == "blob:{id}"
    assert sa_fence.telemetry.default_name_pattern("nightly-report") == "nightly-report"


def test_a_custom_normaliser_is_used_and_patterns_are_capped(
    redis_client: redis.Redis, engine: sa.Engine, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    reader = InMemoryMetricReader()
    telemetry = sa_fence.telemetry.Telemetry(
        meter_provider=MeterProvider(metric_readers=[reader]),
        name_pattern=lambda name: name.split(":", 1)[0],
        max_patterns=2,
    )
    fencer = sa_fence.Fencer(
        redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix, telemetry=telemetry
    )
    with caplog.at_level(logging.WARNING, logger="sa_fence"):
        for name in ("a:1", "b:1", "c:1", "d:1"):
            fencer.acquire(name, ttl=5).release()
    otel = Otel(reader, InMemorySpanExporter(), telemetry, None)
    assert otel.count("sa_fence.lease.acquires", pattern="a") == 1
    assert otel.count("sa_fence.lease.acquires", pattern="b") == 1
    assert otel.count("sa_fence.lease.acquires", pattern="other") == 2
    assert "distinct lease name patterns" in caplog.text


def test_a_normaliser_that_raises_or_returns_no_str_reports_other_and_the_lease_works(
    redis_client: redis.Redis, engine: sa.Engine, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``name_pattern`` is the user's code: it never breaks an acquire."""

    def pattern(name: str) -> Any:
        if name.startswith("raise"):
            raise RuntimeError("the normaliser failed")
        return None if name.startswith("none") else name.split(":", 1)[0]

    reader = InMemoryMetricReader()
    telemetry = sa_fence.telemetry.Telemetry(
        meter_provider=MeterProvider(metric_readers=[reader]), name_pattern=pattern
    )
    fencer = sa_fence.Fencer(
        redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix, telemetry=telemetry
    )
    with caplog.at_level(logging.ERROR, logger="sa_fence"):
        for name in ("raise:1", "none:1", "ok:1"):
            fencer.acquire(name, ttl=5).release()
    otel = Otel(reader, InMemorySpanExporter(), telemetry, None)
    assert otel.count("sa_fence.lease.acquires", pattern="other", outcome="granted") == 2
    assert otel.count("sa_fence.lease.acquires", pattern="ok", outcome="granted") == 1
    assert "name_pattern('raise:1') raised" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name_pattern": "job:{n}"}, TypeError, "name_pattern must be a callable str -> str"),
        ({"max_patterns": 0}, ValueError, "max_patterns must be a whole number >= 1"),
        ({"max_patterns": True}, ValueError, "max_patterns must be a whole number >= 1"),
        ({"root_spans": "yes"}, TypeError, "root_spans must be True or False"),
    ],
)
def test_bad_telemetry_arguments_are_refused(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        sa_fence.telemetry.Telemetry(**kwargs)


# ------------------------------------------------------------ asyncio


async def test_async_acquire_and_release_report_as_the_sync_ones_do(
    otel: Otel, async_engine: Any, key_prefix: str
) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        fencer = sa_fence.AsyncFencer(
            client, async_engine, sequence=SEQUENCE, key_prefix=key_prefix, telemetry=otel.telemetry
        )
        with otel.tracer.start_as_current_span("caller"):
            async with fencer.acquire("job:5", ttl=5):
                with pytest.raises(sa_fence.LeaseNotAcquiredError):
                    await fencer.acquire("job:5", ttl=5)
    finally:
        await client.aclose()
    assert otel.count("sa_fence.lease.acquires", pattern="job:{n}", outcome="granted") == 1
    assert otel.count("sa_fence.lease.acquires", outcome="busy") == 1
    assert otel.count("sa_fence.lease.hold.duration", outcome="released") == 1
    leases = otel.finished("sa_fence.lease")
    assert sorted(s.attributes[OUTCOME] for s in leases) == ["busy", "granted"]  # type: ignore[index]
    assert sorted(str(s.attributes.get("sa_fence.release")) for s in leases) == [  # type: ignore[union-attr]
        "None",  # the busy acquire's: it held nothing
        "released",
    ]


# ------------------------------------------------------------ logging


def test_records_come_from_module_loggers_under_sa_fence_with_extra_fields_and_no_owner(
    tfencer: sa_fence.Fencer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="sa_fence"):
        lease = tfencer.acquire("job:1", ttl=0.3, renew=True)
        expire(lease)
        deadline = time.monotonic() + 2
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(sa_fence.LeaseLostError) as lost:
            lease.check()
        lease.release()
    lost_records = [r for r in caplog.records if getattr(r, "sa_fence_outcome", None) == "lost"]
    assert len(lost_records) == 1
    record = lost_records[0]
    assert record.name == "sa_fence.lease.sync"
    assert record.sa_fence_lease == "job:1"  # type: ignore[attr-defined]
    assert record.sa_fence_pattern == "job:{n}"  # type: ignore[attr-defined]
    assert record.sa_fence_token == lease.token  # type: ignore[attr-defined]
    granted = [r for r in caplog.records if getattr(r, "sa_fence_outcome", None) == "granted"]
    assert granted
    assert granted[0].name == "sa_fence.telemetry"
    everything = caplog.text + str(lost.value) + repr(lease)
    everything += "".join(str(vars(r)) for r in caplog.records)
    assert lease.owner not in everything


def test_urls_are_shown_without_their_password() -> None:
    from sa_fence.cli.redact import redact_url as redact

    assert redact("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"
    assert "s3cret" not in redact(sa.make_url("postgresql+psycopg://u:s3cret@h/db"))


def test_no_message_of_the_package_renders_a_url_with_its_password() -> None:
    """Every URL the package prints goes through a redaction (a grep of the source)."""
    import pathlib
    import re

    root = pathlib.Path(sa_fence.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):  # the tools too: they print the most URLs
        for number, line in enumerate(path.read_text().splitlines(), 1):
            # a URL variable interpolated into text without going through a redaction
            if re.search(r"\{(redis_url|url|pg|dsn)\}", line) and "redact" not in line:
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert offenders == []


# ------------------------------------------------------------ no API installed


def _fencer_code(engine: sa.Engine, key_prefix: str, telemetry: str = "None") -> str:
    """Python source making ``fencer`` on the test servers, for a fresh interpreter."""
    url = engine.url.render_as_string(hide_password=False)
    return (
        f"fencer = sa_fence.Fencer(redis.Redis.from_url({REDIS_URL!r}), "
        f"sa.create_engine({url!r}), sequence={SEQUENCE!r}, key_prefix={key_prefix!r}, "
        f"telemetry={telemetry})"
    )


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (for process-wide state: imports, global providers)."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_without_the_opentelemetry_api_everything_works_and_reports_nothing(
    engine: sa.Engine, key_prefix: str
) -> None:
    code = f"""
import sys
sys.modules["opentelemetry"] = None  # as if not installed
import redis, sqlalchemy as sa, sa_fence
from sa_fence.lease import lifecycle
from sa_fence import telemetry as _telemetry
assert not _telemetry.Telemetry().enabled
{_fencer_code(engine, key_prefix)}
with fencer.acquire("job:1", ttl=5) as lease:
    print("token", lease.token)
"""
    done = _run_python(code)
    assert done.stdout.startswith("token ")


#: Subprocess source: the SDK pieces, and global providers reporting to
#: ``reader`` and ``exporter`` (for the tests of providers set late).
_SDK_IMPORTS = """from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
"""
_SET_GLOBAL_PROVIDERS = """reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
exporter = InMemorySpanExporter()
tracers = TracerProvider()
tracers.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(tracers)
"""


def test_global_providers_set_after_the_fencer_was_made_receive_its_signals(
    engine: sa.Engine, key_prefix: str
) -> None:
    """The default Telemetry reports through the API's global proxies: providers
    set later (as applications often do, after importing their modules) get
    every counter, histogram (inside a trace or not) and span.  A subprocess:
    the globals are set once."""
    code = f"""
import redis, sqlalchemy as sa, sa_fence
{_SDK_IMPORTS}
{_fencer_code(engine, key_prefix, "sa_fence.telemetry.Telemetry()")}  # the API's proxies
{_SET_GLOBAL_PROVIDERS}with trace.get_tracer("app").start_as_current_span("request"):
    fencer.acquire("job:1", ttl=5).release()
fencer.acquire("job:2", ttl=5).release()  # outside a trace: recorded at collection
metrics_ = {{m.name: m for rm in reader.get_metrics_data().resource_metrics
            for sm in rm.scope_metrics for m in sm.metrics}}
print(metrics_["sa_fence.lease.hold.duration"].data.data_points[0].count)
print(sorted(metrics_))
print(sorted(s.name for s in exporter.get_finished_spans()))
"""
    done = _run_python(code)
    held, metric_names, span_names = done.stdout.splitlines()[-3:]
    assert held == "2"
    for name in (
        "sa_fence.lease.acquires",
        "sa_fence.lease.acquire.duration",
        "sa_fence.lease.hold.duration",
    ):
        assert repr(name) in metric_names
    assert span_names == "['request', 'sa_fence.lease']"


def test_with_the_apis_proxies_and_no_provider_nothing_is_made_and_refusals_still_count(
    engine: sa.Engine, key_prefix: str
) -> None:
    """No provider set (the API installed, no SDK configured): no span is started, not
    even inside a caller's trace, and no histogram measurement is taken or kept (the
    proxies would drop them); a stale COMMIT refused then is still counted, and the
    providers set afterwards get every signal of the next transaction.  A subprocess:
    the globals are set once."""
    code = f"""
import redis, sqlalchemy as sa, sa_fence
{_SDK_IMPORTS}from sqlalchemy.orm import sessionmaker
from sa_fence.lease import lifecycle
from sa_fence import telemetry as _telemetry
from sa_fence.testing import expire
from tests.models import Audit

{_fencer_code(engine, key_prefix, "sa_fence.telemetry.Telemetry()")}  # the API's proxies
telemetry = fencer._telemetry
make_session = sa_fence.install(sessionmaker(fencer.engine))
# a caller's trace from elsewhere (a propagated parent): a valid span context
parent = trace.NonRecordingSpan(trace.SpanContext(1, 2, is_remote=True))
pending = _telemetry._providers[_telemetry._GLOBAL].pending
with trace.use_span(parent):
    assert telemetry.start_span("x", {{}}) is _telemetry._NOOP
    old = fencer.acquire("job:1", ttl=5)
    with make_session() as session:
        old.bind(session)
        session.add(Audit(message="late"))
        session.flush()
        expire(old)
        with fencer.acquire("job:1", ttl=5):
            try:
                session.commit()
            except sa_fence.StaleTokenError:
                print("refused")
    with fencer.acquire("job:2", ttl=5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Audit(message="on time"))
        session.commit()
print("pending", len(pending))

{_SET_GLOBAL_PROVIDERS}with trace.get_tracer("app").start_as_current_span("request"):
    with fencer.acquire("job:3", ttl=5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Audit(message="traced"))
        session.commit()
found = {{m.name: m for rm in reader.get_metrics_data().resource_metrics
         for sm in rm.scope_metrics for m in sm.metrics}}
print(sum(p.value for p in found["sa_fence.write.stale_refused"].data.data_points))
print(sum(p.count for p in found["sa_fence.commit_check.duration"].data.data_points))
print(sorted(s.name for s in exporter.get_finished_spans()))
"""
    done = _run_python(code)
    lines = done.stdout.splitlines()[-5:]
    assert lines[:2] == ["refused", "pending 0"]
    refused, checks, span_names = lines[2:]
    assert refused == "1"  # counted before any provider was set
    assert checks == "1"  # the one after: none was kept from before
    assert span_names == (
        "['request', 'sa_fence.commit_check', 'sa_fence.flush', 'sa_fence.lease']"
    )
