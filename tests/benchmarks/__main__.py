"""``make bench``: sa-fence next to the peers a user would pick instead, in one run.

``python -m tests.benchmarks [--pg URL] [--redis URL] [--rounds N]
[--memory-cycles N] [--sections lease,memory,flush,calls,guard,contention] [--plot PATH]
[--quick] [--strict]``

Sections (each module's docstring says what it measures and how):

* lease: lease cycle, sa-fence vs redis-py Lock, python-redis-lock, pottery
  Redlock (1 master), a PostgreSQL advisory lock and the hand-written floor;
* flush: fenced vs plain vs ``version_id_col``, update of 1..1000 rows, delete;
* calls: Python function calls per op (cProfile; deterministic where times are
  not): plain vs fenced update/delete of 1 and 1000 rows, a lease cycle, and
  where the fenced transaction's extra calls go;
* guard: the database-side guard trigger's price on INSERT, UPDATE, DELETE;
* contention: workers with induced stalls past the TTL, stale writes accepted;
* memory: RSS after 100k lease cycles vs after 1k.

Contenders are timed in one process, interleaved op by op (A B A B ...),
the order rotated every round; medians and ratios are printed with the
targets (PASS/MISS).  It creates its own database (dropped at the end, also
on error) and Redis keys under a unique prefix (deleted at the end).  Not a
test: the exit status is 0 unless ``--strict`` is given and a target is
missed.  ``--quick`` runs every section with tiny counts (the smoke test in
``make test``): its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import textwrap
import time
from pathlib import Path

import psycopg
import redis
import sqlalchemy as sa

from sa_fence.cli.bench import FlushBench, Progress, bench_objects, make_schema

from . import calls, contention, flush, guard, lease, memory, plot
from .common import DEFAULT_PG, DEFAULT_REDIS, Config, Target, temporary_database

SECTIONS = ("lease", "memory", "flush", "calls", "guard", "contention")
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PLOT = ROOT / "docs" / "benchmarks-flush.svg"


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {unknown or text!r}; choose from {','.join(SECTIONS)}"
        )
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when inside it (no machine paths in logs
    that end up in the docs)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.benchmarks",
        description="sa-fence next to its peers: lease cycle, flush, guard, contention, memory.",
    )
    parser.add_argument("--pg", default=DEFAULT_PG, help="SQLAlchemy URL of the server")
    parser.add_argument("--redis", default=DEFAULT_REDIS, help="Redis URL")
    parser.add_argument("--rounds", type=_positive, default=10, help="interleaved rounds")
    parser.add_argument(
        "--memory-cycles", type=_positive, default=100_000, help="lease cycles (memory)"
    )
    parser.add_argument("--sections", type=_sections, default=list(SECTIONS))
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="SVG to write")
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    parser.add_argument("--quick", action="store_true", help="tiny counts (smoke run)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    config = Config(
        rounds=1 if args.quick else args.rounds,
        rows=20 if args.quick else 1000,
        quick=args.quick,
        memory_cycles=args.memory_cycles,
    )
    progress = Progress(enabled=not args.quiet)
    server = sa.make_url(args.pg)
    client = redis.Redis.from_url(args.redis)
    targets: list[Target] = []
    started = time.perf_counter()
    with temporary_database(server) as url:
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                version = conn.execute(sa.text("SHOW server_version")).scalar_one()
            redis_version = client.info("server")["redis_version"]
            print(
                f"sa-fence benchmarks: {machine()}; PostgreSQL {version.split()[0]}, "
                f"Redis {redis_version}, Python {sys.version.split()[0]}, "
                f"SQLAlchemy {sa.__version__}, psycopg {psycopg.__version__}, "
                f"redis-py {redis.__version__}; {config.rounds} rounds"
                + ("; QUICK (smoke run, numbers meaningless)" if config.quick else "")
            )
            schema = make_schema()
            with bench_objects(engine, client, schema) as fencer:
                if "lease" in args.sections:
                    targets += lease.report(
                        *lease.run(fencer, client, url, schema, config, progress)
                    )
                # before the flush section, whose dead rows autovacuum cleans up
                # afterwards, competing for the two cores
                if "memory" in args.sections:
                    targets += memory.report(memory.run(fencer, config, progress))
                if "flush" in args.sections or "calls" in args.sections:
                    with fencer.acquire("flush", ttl=3600) as held:
                        bench = FlushBench(engine, schema, held, config.rows)
                        bench.seed()
                        if "flush" in args.sections:
                            result = flush.run(bench, config, progress)
                        if "calls" in args.sections:
                            counted = calls.run(
                                url, client, schema, fencer.key_prefix, config, progress
                            )
                    if "flush" in args.sections:
                        targets += flush.report(result, config.rows)
                        if not args.no_plot:
                            host = machine().split(",")[0]
                            subtitle = f"PostgreSQL {version.split()[0]}, {host}"
                            if plot.write(flush.curve(result), args.plot, subtitle):
                                print(f"  plot written to {_shown(args.plot)}")
                            else:
                                print("  (no plot: matplotlib not installed)")
                    if "calls" in args.sections:
                        targets += calls.report(counted)
                if "guard" in args.sections:
                    targets += guard.report(guard.run(url, config, progress))
                if "contention" in args.sections:
                    results = contention.run(engine, client, fencer, config, progress)
                    targets += contention.report(results, config)
                    targets += [
                        Target(
                            "stale writes accepted, sa-fence",
                            float(r.stale_accepted),
                            0.0,
                            "writes",
                        )
                        for r in results
                        if r.contender == "sa-fence"
                    ]
        finally:
            engine.dispose()
            client.close()
    print(f"\ntargets{' (QUICK run: not meaningful)' if config.quick else ''}")
    for t in targets:
        print(
            f"  {t.name:<42}{t.value:>9.{t.decimals}f} {t.unit:<22} <= {t.limit:<6g} "
            f"{'PASS' if t.met else 'MISS'}"
        )
        if not t.met and t.why_missed and not config.quick:
            print(
                textwrap.fill(t.why_missed, 96, initial_indent=" " * 6, subsequent_indent=" " * 6)
            )
    missed = [t for t in targets if not t.met]
    took = time.perf_counter() - started
    print(
        f"\n{'all targets met' if not missed else f'{len(missed)} target(s) missed'} ({took:.0f} s)"
    )
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
