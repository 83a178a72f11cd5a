"""What telemetry costs: a lease cycle and a fenced flush, with and without an SDK.

``python -m tests.benchmarks.telemetry [--pg URL] [--redis URL] [--rounds N]
[--ops N] [--quick]`` (``make bench`` runs it after the other sections).

Three fencers on the same servers, differing only in their
:class:`sa_fence.Telemetry`:

* ``off``: every instrument and the tracer replaced by sa-fence's own no-op
  (what a process without the OpenTelemetry API runs): the floor;
* ``api``: the default, the global providers with no SDK set (the API's
  no-ops): what most users run;
* ``metrics``: the SDK's MeterProvider only (no tracer provider: the API's
  no-op spans), for users who export metrics and no traces;
* ``sdk``: an OpenTelemetry SDK installed: a MeterProvider with an
  in-memory reader (aggregation happens at record time, so the cost is
  real) and a TracerProvider (sampling every trace: the worst case) whose
  BatchSpanProcessor hands spans to an exporter that drops them (so the
  measured cost is the SDK's, not an exporter's network).

Ops (each timed alone, the variants interleaved op by op and the order
rotated every round, as in the other sections): a lease cycle (acquire
with token + release) and a fenced update + commit of one row through a
bound session (flush span, first-write check, commit check).  Medians per
op and the ratios api/off and sdk/off are printed.  Not a test.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis
import sqlalchemy as sa
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

import sa_fence
from sa_fence import _telemetry

from .common import DEFAULT_PG, DEFAULT_REDIS, temporary_database

VARIANTS = ("off", "api", "metrics", "sdk")
#: The largest ratio to the floor accepted for each variant (printed PASS/MISS).
LIMITS = {"api": 1.02, "metrics": 1.05, "sdk": 1.10}


class _Dropping(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def off() -> sa_fence.Telemetry:
    """A Telemetry whose every instrument is sa-fence's own no-op."""
    t = sa_fence.Telemetry()
    noop = _telemetry._NOOP
    t.enabled = False
    t.tracer = noop
    for attr in (
        "acquires",
        "renewals",
        "lost",
        "stale_refused",
        "unfenced_refused",
        "acquire_duration",
        "hold_duration",
        "first_write_delay",
        "commit_check_duration",
    ):
        setattr(t, attr, noop)
    return t


def with_sdk(
    traces: bool = True,
) -> tuple[sa_fence.Telemetry, Callable[[], None]]:
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    tracers = TracerProvider()
    tracers.add_span_processor(BatchSpanProcessor(_Dropping()))

    def shutdown() -> None:
        reader.get_metrics_data()
        meters.shutdown()
        tracers.shutdown()

    telemetry = sa_fence.Telemetry(
        meter_provider=meters, tracer_provider=tracers if traces else None
    )
    return telemetry, shutdown


class Base(DeclarativeBase):
    pass


SEQUENCE = "bench_telemetry_seq"
sa_fence.fence_sequence(Base.metadata, SEQUENCE)


class Item(sa_fence.Fenced, Base):
    __tablename__ = "telemetry_items"

    id: Mapped[int] = mapped_column(primary_key=True)
    payload: Mapped[str]


def _timed(op: Callable[[], object]) -> float:
    started = time.perf_counter()
    op()
    return time.perf_counter() - started


def measure(
    ops: dict[str, Callable[[], object]], rounds: int, per_round: int
) -> dict[str, list[float]]:
    """Per-round medians of each variant's op, interleaved op by op."""
    names = list(ops)
    medians: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(per_round):
            for n in order:
                times[n].append(_timed(ops[n]))
        for n in names:
            medians[n].append(statistics.median(times[n]))
    return medians


def report(title: str, medians: dict[str, list[float]], misses: list[str]) -> None:
    floor = medians["off"]
    print(f"\n{title}: median per op, ratio to 'off' (range of the per-round ratios)")
    for n, values in medians.items():
        ratios = [v / f for v, f in zip(values, floor, strict=True)]
        ratio = statistics.median(values) / statistics.median(floor)
        line = f"  {n:<7} {statistics.median(values) * 1e6:9.1f} us   {ratio:6.3f}x"
        line += f"  ({min(ratios):.3f} to {max(ratios):.3f})"
        limit = LIMITS.get(n)
        if limit is not None:
            verdict = "PASS" if ratio <= limit else "MISS"
            line += f"   <= {limit:g}  {verdict}"
            if verdict == "MISS":
                misses.append(f"{title}, {n}: {ratio:.3f}x")
        print(line)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.telemetry")
    parser.add_argument("--pg", default=DEFAULT_PG)
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ops", type=int, default=200, help="ops per variant per round")
    parser.add_argument("--quick", action="store_true", help="tiny counts (smoke run)")
    args = parser.parse_args(argv)
    # the cycles bind nothing on purpose: not the "never bound" warning
    logging.getLogger("sa_fence._lease").setLevel(logging.ERROR)
    rounds, per_round = (2, 5) if args.quick else (args.rounds, args.ops)
    client = redis.Redis.from_url(args.redis)
    prefix = f"sa_fence_bench_telemetry:{uuid.uuid4().hex[:8]}:"
    shutdown: Callable[[], None] = lambda: None  # noqa: E731
    misses: list[str] = []
    print(
        f"telemetry overhead: {rounds} rounds x {per_round} ops per variant"
        + ("; QUICK (numbers meaningless)" if args.quick else "")
    )
    with temporary_database(sa.make_url(args.pg)) as url:
        engine = sa.create_engine(url)
        try:
            Base.metadata.create_all(engine)
            Session = sa_fence.install(sessionmaker(engine))
            sdk, shutdown = with_sdk()
            metrics, _ = with_sdk(traces=False)
            telemetries = {
                "off": off(),
                "api": sa_fence.Telemetry(),
                "metrics": metrics,
                "sdk": sdk,
            }
            fencers = {
                n: sa_fence.Fencer(
                    client, engine, sequence=SEQUENCE, key_prefix=prefix, telemetry=t
                )
                for n, t in telemetries.items()
            }
            with Session() as session, sa_fence.unfenced(session):
                session.add_all(Item(id=i, payload="x") for i in range(len(VARIANTS)))
                session.commit()

            def cycle(fencer: sa_fence.Fencer, name: str) -> Callable[[], object]:
                return lambda: fencer.acquire(name, ttl=30).release()

            leases = {n: f.acquire(f"flush:{n}", ttl=3600) for n, f in fencers.items()}
            counter = iter(range(10**9))

            def flush(n: str, item_id: int) -> Callable[[], object]:
                lease = leases[n]

                def op() -> None:
                    with Session() as session:
                        lease.bind(session)
                        item = session.get(Item, item_id)
                        assert item is not None
                        item.payload = str(next(counter))
                        session.commit()

                return op

            warm = 3 if args.quick else 50
            cycles = {n: cycle(f, f"cycle:{n}") for n, f in fencers.items()}
            flushes = {n: flush(n, i) for i, n in enumerate(VARIANTS)}
            for ops in (cycles, flushes):
                for op in ops.values():
                    for _ in range(warm):
                        op()
            report("lease cycle", measure(cycles, rounds, per_round), misses)
            report("fenced update + commit, 1 row", measure(flushes, rounds, per_round), misses)
            for lease in leases.values():
                lease.release()
            for fencer in fencers.values():
                fencer.close()
        finally:
            shutdown()
            engine.dispose()
            for key in client.scan_iter(match=f"{prefix}*", count=1000):
                client.delete(key)
            client.close()
    if misses and not args.quick:
        print(f"\ntelemetry: {len(misses)} ratio(s) above the limit: {'; '.join(misses)}")
    else:
        print("\ntelemetry: ratios within the limits" + (" (QUICK)" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
