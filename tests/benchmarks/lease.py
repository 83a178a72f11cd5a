"""Lease cycle: acquire (with a token, for sa-fence and the floor) + release.

Contenders, all against the same Redis and PostgreSQL, interleaved op by op:

* ``sa-fence``: ``Fencer.acquire(name, ttl)`` + ``Lease.release()``: ACQUIRE
  script, ``nextval`` in its own committed transaction, CONFIRM script,
  RELEASE script;
* ``hand-written floor``: the same protocol with raw redis-py and psycopg
  calls (:class:`sa_fence._bench.HandWritten`);
* ``redis-py Lock``: ``client.lock(name, timeout=ttl)``, no token;
* ``python-redis-lock``: ``redis_lock.Lock(client, name, expire=ttl)``, no token
  (its release also pushes to a signal list for BLPOP waiters);
* ``pottery Redlock``: ``Redlock(key=..., masters={client})``, one master, no token;
* ``PG advisory lock``: ``pg_try_advisory_lock`` + ``pg_advisory_unlock`` on an
  autocommit psycopg connection, no token.

A peer whose package is not installed is left out with a note (``make bench``
installs them through the ``bench`` extra).
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import psycopg
import redis
import sqlalchemy as sa

import sa_fence
from sa_fence._bench import (
    HandWritten,
    Op,
    Progress,
    Schema,
    Timing,
    fmt_time,
    interleave,
    psycopg_conninfo,
    ratio_range,
    sa_fence_cycle,
)

from .common import Config, Target

TTL = 30.0
TARGET = 1.05  # sa-fence / hand-written floor


def peers(
    client: redis.Redis, conninfo: str, prefix: str
) -> tuple[dict[str, Op], list[str], psycopg.Connection[Any]]:
    """The peer contenders that are installed, and notes on those that are not."""
    ops: dict[str, Op] = {}
    notes: list[str] = []

    def redis_py() -> None:
        lock = client.lock(f"{prefix}:redis-py", timeout=TTL)
        if not lock.acquire(blocking=False):
            raise RuntimeError("redis-py Lock: held")
        lock.release()

    ops["redis-py Lock"] = Op(redis_py)

    try:
        import redis_lock
    except ImportError:
        notes.append("python-redis-lock not installed: pip install -e '.[bench]'")
    else:

        def python_redis_lock() -> None:
            lock = redis_lock.Lock(client, f"{prefix}:python-redis-lock", expire=int(TTL))
            if not lock.acquire(blocking=False):
                raise RuntimeError("python-redis-lock: held")
            lock.release()

        ops["python-redis-lock"] = Op(python_redis_lock)

    try:
        from pottery import Redlock
    except ImportError:
        notes.append("pottery not installed: pip install -e '.[bench]'")
    else:

        def pottery_redlock() -> None:
            lock = Redlock(key=f"{prefix}:pottery", masters={client}, auto_release_time=TTL)
            if not lock.acquire(blocking=False):
                raise RuntimeError("pottery Redlock: held")
            lock.release()

        ops["pottery Redlock (1 master)"] = Op(pottery_redlock)

    pg = psycopg.connect(conninfo, autocommit=True)
    key = zlib.crc32(prefix.encode())

    def advisory() -> None:
        row = pg.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        if not (row and row[0]):
            raise RuntimeError("advisory lock: held")
        pg.execute("SELECT pg_advisory_unlock(%s)", (key,))

    ops["PG advisory lock"] = Op(advisory)
    return ops, notes, pg


def run(
    fencer: sa_fence.Fencer,
    client: redis.Redis,
    url: sa.URL,
    schema: Schema,
    config: Config,
    progress: Progress,
) -> tuple[dict[str, tuple[Timing, Timing]], list[str]]:
    """{contender: (its timing, the floor's timing in the same run)}, notes.

    Each contender is interleaved with the hand-written floor alone, one pair
    after the other, so every "x floor" is a clean pairwise ratio.  (All six
    in one rotation disturb each other: pottery starts a thread pool per
    acquire, whose threads still run while the next contender is timed, and
    on two cores that slowed every other contender by 25-45%.)
    """
    conninfo = psycopg_conninfo(url)
    ops, notes, pg = peers(client, conninfo, f"{fencer.key_prefix}peer")
    floor = HandWritten(client, conninfo, schema.sequence, f"{fencer.key_prefix}floor")
    contenders = {"sa-fence": Op(sa_fence_cycle(fencer, "cycle")), **ops}
    pairs: dict[str, tuple[Timing, Timing]] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pottery warns about a single master
            for name, op in contenders.items():
                timings = interleave(
                    {name: op, "hand-written floor": Op(floor.cycle)},
                    rounds=config.rounds,
                    per_round=2 if config.quick else 50,
                    progress=progress,
                    label=f"lease cycle: {name} vs floor",
                )
                pairs[name] = (timings[name], timings["hand-written floor"])
    finally:
        floor.close()
        pg.close()
    return pairs, notes


def report(pairs: dict[str, tuple[Timing, Timing]], notes: list[str]) -> list[Target]:
    n = len(pairs["sa-fence"][1].samples)
    print(
        f"\nlease cycle (acquire + release), each contender interleaved with the "
        f"hand-written floor, median of {n} each"
    )
    print(
        f"{'contender':<28}{'median':>11}{'floor, same run':>17}{'x floor':>10}"
        f"{'per-round range':>18}  token issued"
    )
    for name, (timing, floor) in sorted(pairs.items(), key=lambda kv: kv[1][0].median):
        low, high = ratio_range(timing, floor)
        token = "yes" if name == "sa-fence" else "no"
        print(
            f"{name:<28}{fmt_time(timing.median):>11}{fmt_time(floor.median):>17}"
            f"{timing.median / floor.median:>9.3f}x{f'{low:.2f}-{high:.2f}x':>18}  {token}"
        )
    print("  (the floor issues a token too: SET NX PX, nextval, owner-checked confirm+release)")
    for note in notes:
        print(f"  ({note})")
    timing, floor = pairs["sa-fence"]
    why = (
        "~45 us over the floor: sa-fence's own Python per cycle (13.5 us with stubbed I/O: "
        "checks, Lease object, renewer bookkeeping), the token path's lock/fork/recycle "
        "checks (~10 us), and ACQUIRE as a Lua script (GET+SET, idempotent on resend) "
        "instead of a bare SET NX PX (~10 us). The token draw through a SQLAlchemy "
        "Connection (1.70x) was fixed; see docs/benchmarks.md"
    )
    ratio = timing.median / floor.median
    return [Target("lease cycle", ratio, TARGET, "x hand-written floor", why)]
