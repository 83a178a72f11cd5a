"""The sample dashboard of docs/observability.md, drawn from a real run.

``python -m tests.benchmarks.dashboard [--pg URL] [--redis URL] [--seconds N]
[--out PATH]``: four worker threads run fenced jobs on eight names for
``--seconds`` against the real servers, with an OpenTelemetry SDK reading
sa-fence's metrics once a second; one worker in ten "pauses" past its TTL
(its lease is ended in Redis, as a long GC pause would), so a newer holder
takes the name and the paused worker's commit is refused.  The per-second
rates and latency quantiles are plotted with matplotlib (the ``bench``
extra) into a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import random
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from sqlalchemy.orm import sessionmaker

import sa_fence
from sa_fence.testing import expire

from .common import DEFAULT_PG, DEFAULT_REDIS, temporary_database
from .telemetry import SEQUENCE, Base, Item

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "docs" / "observability-dashboard.png"


def _snapshot(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = defaultdict(list)
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                found[metric.name].extend(metric.data.data_points)
    return found


def _counter(points: list[Any], key: str) -> dict[str, float]:
    by: dict[str, float] = defaultdict(float)
    for p in points:
        by[str(p.attributes.get(key, ""))] += p.value if hasattr(p, "value") else p.count
    return by


def _buckets(points: list[Any]) -> tuple[list[float], list[int]]:
    bounds: list[float] = []
    counts: list[int] = []
    for p in points:
        if not bounds:
            bounds, counts = list(p.explicit_bounds), [0] * len(p.bucket_counts)
        counts = [a + b for a, b in zip(counts, p.bucket_counts, strict=True)]
    return bounds, counts


def _quantile(bounds: list[float], counts: list[int], q: float) -> float | None:
    total = sum(counts)
    if total == 0:
        return None
    seen = 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= q * total:
            return bounds[i] if i < len(bounds) else bounds[-1]
    return bounds[-1]


def run(pg: str, redis_url: str, seconds: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logging.getLogger("sa_fence").setLevel(logging.ERROR)
    reader = InMemoryMetricReader()
    telemetry = sa_fence.telemetry.Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    client = redis.Redis.from_url(redis_url)
    prefix = f"sa_fence_dashboard:{uuid.uuid4().hex[:8]}:"
    with temporary_database(sa.make_url(pg)) as url:
        engine = sa.create_engine(url, pool_size=8)
        Base.metadata.create_all(engine)
        Session = sa_fence.install(sessionmaker(engine))
        with Session() as session, sa_fence.unfenced(session):
            session.add_all(Item(id=i, payload="x") for i in range(8))
            session.commit()
        fencer = sa_fence.Fencer(
            client, engine, sequence=SEQUENCE, key_prefix=prefix, telemetry=telemetry
        )
        stop = threading.Event()

        @sa_fence.fenced("item:{item_id}", ttl=2, fencer=fencer, session=Session, on_busy="skip")
        def work(item_id: int, pause: bool) -> None:
            session = sa_fence.current_session()
            item = session.get(Item, item_id)
            assert item is not None
            item.payload = str(random.random())
            time.sleep(random.uniform(0.005, 0.05))
            if pause:  # a long pause: the lease runs out and another worker takes over
                expire(sa_fence.current_lease())
                fencer.acquire(f"item:{item_id}", ttl=2).release()

        def worker() -> None:
            while not stop.is_set():
                with contextlib.suppress(sa_fence.FenceError):
                    work(random.randrange(8), random.random() < 0.1)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        series: list[dict[str, list[Any]]] = []
        try:
            for _ in range(seconds):
                time.sleep(1)
                series.append(_snapshot(reader))
        finally:
            stop.set()
            for t in threads:
                t.join()
            fencer.close()
            engine.dispose()
            for key in client.scan_iter(match=f"{prefix}*", count=1000):
                client.delete(key)
            client.close()

    xs = list(range(1, len(series)))
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), constrained_layout=True)
    fig.suptitle("sa-fence: one run, 4 workers, 8 names, 1 in 10 pausing past its TTL")

    def rate(name: str, key: str) -> dict[str, list[float]]:
        lines: dict[str, list[float]] = defaultdict(list)
        for before, after in itertools.pairwise(series):
            a, b = _counter(before.get(name, []), key), _counter(after.get(name, []), key)
            for k in set(a) | set(b):
                lines[k].append(b.get(k, 0.0) - a.get(k, 0.0))
        return lines

    ax = axes[0][0]
    for outcome, ys in sorted(rate("sa_fence.lease.acquires", "sa_fence.outcome").items()):
        ax.plot(xs[: len(ys)], ys, label=outcome)
    ax.set_title("sa_fence.lease.acquires (per second, by outcome)")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[0][1]
    for name, label in (
        ("sa_fence.lease.acquire.duration", "acquire"),
        ("sa_fence.commit_check.duration", "commit check"),
    ):
        p50, p95 = [], []
        for before, after in itertools.pairwise(series):
            _b0, c0 = _buckets(before.get(name, []))
            b1, c1 = _buckets(after.get(name, []))
            diff = [y - x for x, y in zip(c0 or [0] * len(c1), c1, strict=True)]
            p50.append((_quantile(b1, diff, 0.5) or 0) * 1000)
            p95.append((_quantile(b1, diff, 0.95) or 0) * 1000)
        ax.plot(xs[: len(p50)], p50, label=f"{label} p50")
        ax.plot(xs[: len(p95)], p95, linestyle="--", label=f"{label} p95")
    ax.set_title("latency (ms, bucket upper bounds)")
    ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[1][0]
    for check, ys in sorted(rate("sa_fence.write.stale_refused", "sa_fence.check").items()):
        ax.bar(xs[: len(ys)], ys, label=f"stale refused: {check}", alpha=0.7)
    ax.set_title("sa_fence.write.stale_refused (per second): alert when > 0")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[1][1]
    for outcome, ys in sorted(rate("sa_fence.lease.hold.duration", "sa_fence.outcome").items()):
        ax.plot(xs[: len(ys)], ys, label=f"releases: {outcome}")
    ax.set_title("sa_fence.lease.hold.duration count (per second, by outcome)")
    ax.legend(loc="upper right", fontsize=8)
    for row in axes:
        for a in row:
            a.set_xlabel("seconds")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"dashboard written to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.dashboard")
    parser.add_argument("--pg", default=DEFAULT_PG)
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    run(args.pg, args.redis, args.seconds, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
