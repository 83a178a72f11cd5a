"""Python function calls per operation: deterministic where times are not.

Each op is run ``warmup`` times (pools, compiled-statement caches, prepared
statements), then ``n`` times under :mod:`cProfile` (enabled around the op
only: a delete's untimed ``prepare``, which puts its rows back, is not
counted), with garbage collection off; the figure is cProfile's total number
of calls (Python functions and C builtins alike) divided by ``n``.  Only the
calling thread is profiled (a lease's renewer thread is not).  The ops run on
an engine and a fencer of this section's own (see :func:`run`), so that what
the other sections did to their engine does not change the counts.

Ops: a plain and a fenced 1-row update+commit (the difference is
"sa-fence's own calls per fenced transaction"), the same for 1000 rows and
for deleting 1 and 1000 rows, and a lease cycle (``Fencer.acquire()`` +
``Lease.release()``), beside two counts of redis-py alone that bound it from
below: one command through its client (a lease cycle sends three scripts that
way) and a cycle of its own ``Lock`` (two commands, no token).  Then "where the
calls go": the fenced 1-row update's
calls next to plain's, grouped by the package (and, for SQLAlchemy, the
subpackage) of the function called, and the functions with the most extra
calls of their own.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
import sqlalchemy as sa

import sa_fence
from sa_fence.cli.bench import (
    FlushBench,
    HandWritten,
    Op,
    Progress,
    Schema,
    sa_fence_cycle,
)

from .common import Config, Target

#: sa-fence's own calls per fenced transaction (fenced minus plain), at most
TRANSACTION_LIMIT = 100
#: calls per lease cycle (acquire + release), at most
CYCLE_LIMIT = 400
#: functions listed under "where the calls go"
TOP = 12

# (substring of a profiled file name, area); the first match wins.
AREAS = (
    ("/sqlalchemy/event/", "SQLAlchemy event dispatch"),
    ("/sqlalchemy/orm/", "SQLAlchemy ORM"),
    ("/sqlalchemy/engine/", "SQLAlchemy engine"),
    ("/sqlalchemy/sql/", "SQLAlchemy SQL compiler/elements"),
    ("/sqlalchemy/", "SQLAlchemy, other"),
    ("/sa_fence/", "sa-fence"),
    ("/psycopg/", "psycopg"),
    ("/redis/", "redis-py"),
)

Key = tuple[str, int, str]  # pstats: (file name, line, function name)


@dataclass
class Count:
    """Calls per op, in total and per function (pstats key)."""

    ops: int
    total: float
    per_function: dict[Key, float] = field(default_factory=dict)
    c_calls_by_caller_area: dict[str, float] = field(default_factory=dict)


def count(op: Op, n: int, warmup: int) -> Count:
    """cProfile's calls per run of ``op`` over ``n`` runs after ``warmup`` unprofiled ones."""
    for _ in range(warmup):
        if op.prepare is not None:
            op.prepare()
        op.run()
    profile = cProfile.Profile()
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(n):
            if op.prepare is not None:
                op.prepare()
            profile.enable()
            op.run()
            profile.disable()
    finally:
        if gc_was_enabled:
            gc.enable()
    stats = pstats.Stats(profile)
    raw: dict[Key, tuple[int, int, float, float, object]] = stats.stats  # type: ignore[attr-defined]
    per_function = {key: value[1] / n for key, value in raw.items()}
    # C calls by the area of their caller: who makes them (pstats keeps the callers)
    c_areas: dict[str, float] = {}
    for key, value in raw.items():
        if key[0] == "~" and key != _DISABLE:
            callers: dict[Key, tuple[int, int, float, float]] = value[4]  # type: ignore[assignment]
            for caller, (_, calls, _, _) in callers.items():
                where_from = area(caller) if caller != _DISABLE else "?"
                c_areas[where_from] = c_areas.get(where_from, 0.0) + calls / n
    # Profile.disable() is itself recorded (once per run): not the op's.
    per_function.pop(_DISABLE, None)
    return Count(n, sum(per_function.values()), per_function, c_areas)


_DISABLE: Key = ("~", 0, "<method 'disable' of '_lsprof.Profiler' objects>")


def area(key: Key) -> str:
    filename = key[0].replace("\\", "/")
    if filename == "~":
        return "C builtins and methods"
    for fragment, name in AREAS:
        if fragment in filename:
            return name
    if filename.startswith("<sqlalchemy generated"):
        return "SQLAlchemy, other"
    if "/site-packages/" in filename:
        return filename.split("/site-packages/", 1)[1].split("/", 1)[0]
    return f"standard library: {filename.rsplit('/', 1)[-1]}"


Row = tuple[str, float, float]  # (what, plain calls per op, fenced calls per op)


def where(fenced: Count, plain: Count) -> tuple[list[Row], list[Row]]:
    """Per area, and for the functions with the most extra calls: (name, plain, fenced),
    largest difference first."""
    plain_areas, fenced_areas = dict(by_area(plain)), dict(by_area(fenced))
    areas = sorted(
        (
            (name, plain_areas.get(name, 0.0), fenced_areas.get(name, 0.0))
            for name in plain_areas.keys() | fenced_areas.keys()
        ),
        key=lambda row: row[1] - row[2],
    )
    extra = {
        key: fenced.per_function.get(key, 0.0) - plain.per_function.get(key, 0.0)
        for key in fenced.per_function.keys() | plain.per_function.keys()
    }
    functions = [
        (label(key), plain.per_function.get(key, 0.0), fenced.per_function.get(key, 0.0))
        for key in sorted(extra, key=lambda key: -extra[key])[:TOP]
    ]
    return areas, functions


def by_area(c: Count) -> list[tuple[str, float]]:
    """Calls per op per area (Python functions where they live, C calls by their caller),
    most first."""
    areas: dict[str, float] = {}
    for key, calls in c.per_function.items():
        if key[0] != "~":
            areas[area(key)] = areas.get(area(key), 0.0) + calls
    for name, calls in c.c_calls_by_caller_area.items():
        areas[name] = areas.get(name, 0.0) + calls
    return sorted(areas.items(), key=lambda item: -item[1])


def account(parts: list[tuple[str, float]], total: float, top: int = 4) -> str:
    """ "N calls: area +a, area +b, ..." for the largest parts, from this run's counts."""
    shown = ", ".join(f"{name} {calls:+.0f}" for name, calls in parts[:top])
    return f"{total:.0f} calls, by area ({shown})"


def label(key: Key) -> str:
    filename, line, name = key
    if filename == "~":
        return name  # e.g. "<method 'get' of 'dict' objects>"
    parts = filename.replace("\\", "/").split("/")
    for top in ("sqlalchemy", "sa_fence", "psycopg", "redis"):
        if top in parts:
            parts = parts[parts.index(top) :]
            break
    else:
        parts = parts[-1:]
    return f"{'/'.join(parts)}:{line}({name})"


@dataclass
class CallsResult:
    n: int
    flush: dict[str, dict[str, Count]] = field(default_factory=dict)  # op -> variant -> count
    cycle: Count | None = None
    redis_command: Count | None = None  # one EVALSHA through redis-py's client
    redis_lock_cycle: Count | None = None  # redis-py Lock: acquire + release
    floor_cycle: Count | None = None  # the hand-written floor: the same four server calls


def ops_counted(rows: int) -> list[tuple[str, str, int]]:
    """(label, kind, rows) of every flush op counted."""
    sizes = sorted({1, rows})
    return [
        (f"{kind} {n} row{'s' if n > 1 else ''}", kind, n)
        for kind in ("update", "delete")
        for n in sizes
    ]


def run(
    url: sa.URL,
    client: redis.Redis,
    schema: Schema,
    key_prefix: str,
    config: Config,
    progress: Progress,
) -> CallsResult:
    """Count on an engine and a fencer of the section's own, made here: an engine that
    has ever had a listener keeps paying SQLAlchemy's dispatch machinery after it was
    removed (and its token grants take the SQLAlchemy path), so counts taken on the
    engine the other sections used depend on which of them ran.  The tables must hold
    ``config.rows`` seeded rows already."""
    engine = sa.create_engine(url)
    fencer = sa_fence.Fencer(client, engine, sequence=schema.sequence, key_prefix=key_prefix)
    floor = HandWritten.beside(fencer, url, f"{key_prefix}calls-floor")
    try:
        with fencer.acquire("calls-flush", ttl=3600) as lease:
            result = _run(FlushBench(engine, schema, lease, config.rows), fencer, config, progress)
        n, warmup = result.n, min(result.n, 20)
        result.floor_cycle = count(Op(floor.cycle), n, warmup)
    finally:
        floor.close()
        fencer.close()
        engine.dispose()
    result.redis_command = count(Op(redis_command(client, key_prefix)), n, warmup)
    result.redis_lock_cycle = count(Op(redis_lock_cycle(client, key_prefix)), n, warmup)
    return result


def redis_command(client: redis.Redis, key_prefix: str) -> Callable[[], object]:
    """One EVALSHA through redis-py's client, as each of a lease cycle's scripts is sent."""
    script = client.register_script("return redis.call('PEXPIRE', KEYS[1], ARGV[1])")
    script([f"{key_prefix}calls-command"], [1000])  # loads it: the op is EVALSHA alone
    key = f"{key_prefix}calls-command"
    sha = script.sha

    def command() -> object:
        return client.execute_command("EVALSHA", sha, 1, key, 1000)

    return command


def redis_lock_cycle(client: redis.Redis, key_prefix: str) -> Callable[[], object]:
    """redis-py's ``Lock``: acquire (SET NX PX) and release (its owner-checked script)."""
    lock = client.lock(f"{key_prefix}calls-lock", timeout=30, blocking=False)

    def cycle() -> object:
        if not lock.acquire():
            raise RuntimeError("the benchmark's redis-py lock was held")
        lock.release()
        return None

    return cycle


def _run(
    bench: FlushBench, fencer: sa_fence.Fencer, config: Config, progress: Progress
) -> CallsResult:
    n, warmup = (2, 1) if config.quick else (200, 20)
    result = CallsResult(n)
    counted = ops_counted(bench.rows)
    progress.start("calls: cProfile per op", len(counted) + 1)
    for name, kind, rows in counted:
        ops = bench.ops(kind, rows, ("plain", "fenced"))
        times = n if rows == 1 else max(2, n // 20)
        result.flush[name] = {
            variant: count(op, times, min(warmup, times)) for variant, op in ops.items()
        }
        progress.step()
    result.cycle = count(Op(sa_fence_cycle(fencer, "calls")), n, warmup)
    progress.step()
    progress.finish()
    return result


def report(result: CallsResult) -> list[Target]:
    print(
        f"\nPython function calls per op (cProfile, Python and C calls, {result.n} ops "
        f"after a warm-up; {max(2, result.n // 20)} for the many-row ops)"
    )
    print(f"{'op':<40}{'plain':>9}{'fenced':>9}{'sa-fence own':>14}{'per row':>10}")
    targets: list[Target] = []
    for name, counts in result.flush.items():
        plain, fenced = counts["plain"].total, counts["fenced"].total
        rows = int(name.split()[1])
        own = fenced - plain
        print(f"{name:<40}{round(plain):>9}{round(fenced):>9}{round(own):>+14}{own / rows:>+10.1f}")
        if rows == 1:
            areas, _ = where(counts["fenced"], counts["plain"])
            parts = [(a, f - p) for a, p, f in areas]
            targets.append(
                Target(
                    f"sa-fence's own calls, {name}",
                    float(round(own)),
                    TRANSACTION_LIMIT,
                    "calls over plain",
                    f"{account(parts, own)}: {WHY_TRANSACTION}",
                    decimals=0,
                )
            )
    assert result.cycle is not None
    cycle = result.cycle.total
    print(f"{'lease cycle (acquire + release)':<40}{'':>9}{round(cycle):>9}")
    cycle_areas = by_area(result.cycle)
    print(
        "  lease cycle by area: "
        + ", ".join(f"{name} {round(calls)}" for name, calls in cycle_areas if round(calls))
    )
    assert result.redis_command is not None
    assert result.redis_lock_cycle is not None
    assert result.floor_cycle is not None
    command, lock = result.redis_command.total, result.redis_lock_cycle.total
    floor = result.floor_cycle.total
    print(f"{'  hand-written floor (same server calls)':<40}{'':>9}{round(floor):>9}")
    print(f"{'  redis-py alone: one EVALSHA':<40}{'':>9}{round(command):>9}")
    print(f"{'  redis-py Lock cycle (no token)':<40}{'':>9}{round(lock):>9}")
    print(
        f"  the cycle's three scripts through redis-py's client: at least "
        f"{round(3 * command)} calls before sa-fence's and psycopg's"
    )
    key = "update 1 row"
    areas, functions = where(result.flush[key]["fenced"], result.flush[key]["plain"])
    print(f"\nwhere the calls go: fenced vs plain, {key}, per op")
    heading = "area: its Python functions + the C calls they make"
    print(f"  {heading:<62}{'plain':>8}{'fenced':>8}{'extra':>8}")
    for name, p, f in areas:
        if round(f - p) == 0:
            continue
        print(f"  {name:<62}{round(p):>8}{round(f):>8}{round(f - p):>+8}")
    print("  functions with the most extra calls")
    for name, p, f in functions:
        print(f"  {name[:62]:<62}{round(p):>8}{round(f):>8}{round(f - p):>+8}")
    targets.append(
        Target(
            "calls per lease cycle",
            float(round(cycle)),
            CYCLE_LIMIT,
            "calls",
            f"{account(cycle_areas, cycle)}: {WHY_CYCLE}; redis-py alone makes "
            f"{round(command)} calls per command and {round(lock)} per cycle of its own "
            f"Lock, so three scripts take {round(3 * command)} before any of sa-fence's; "
            f"the hand-written floor (SET NX PX, the grant, CONFIRM and RELEASE through "
            f"redis-py and psycopg, nothing else) makes {round(floor)}, so sa-fence's "
            f"lifecycle adds {round(cycle - floor):+} to the floor",
            decimals=0,
        )
    )
    return targets


WHY_TRANSACTION = (
    "profiled (cProfile, callers): sa-fence's own code (session listeners, bind(), the "
    "connection steps: statement rewrite, row count check, arm, COMMIT), a few calls of its "
    "telemetry (no SDK set up: no span is made) and of the lease's validity checks, and "
    "SQLAlchemy's (the ORM's expiry of obj.fence after the UPDATE, the session events' "
    "dispatch, binding the token); see 'where the calls go' above and docs/benchmarks.md"
)
WHY_CYCLE = (
    "profiled: redis-py's client path for the three scripts (its connection pool, command "
    "encoding, reply parsing and redis-py 8's own observability recorder) and the C calls "
    "it makes are most of them; sa-fence's own "
    "(argument checks, the Lease object, the renewer bookkeeping) and psycopg's for the "
    "grant come next; see docs/benchmarks.md"
)
