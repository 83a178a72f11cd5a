"""Lease cycle: acquire (with a token, for sa-fence and the floor) + release.

Contenders, all against the same Redis and PostgreSQL, interleaved op by op:

* ``sa-fence``: ``Fencer.acquire(name, ttl)`` + ``Lease.release()``: ACQUIRE
  script, the grant (one autocommit statement that draws the token and
  advances the lease register), CONFIRM script, RELEASE script;
* ``hand-written floor``: the same protocol with raw redis-py and psycopg
  calls (:class:`sa_fence.cli.bench.HandWritten`): ``SET NX PX``, the same grant
  statement with the same parameters, owner-checked CONFIRM and RELEASE;
* ``redis-py Lock``: ``client.lock(name, timeout=ttl)``, no token;
* ``python-redis-lock``: ``redis_lock.Lock(client, name, expire=ttl)``, no token
  (its release also pushes to a signal list for BLPOP waiters);
* ``pottery Redlock``: ``Redlock(key=..., masters={client})``, one master, no token;
* ``PG advisory lock``: ``pg_try_advisory_lock`` + ``pg_advisory_unlock`` on an
  autocommit psycopg connection, no token.

A peer whose package is not installed is left out with a note (``make bench``
installs them through the ``bench`` extra).

sa-fence is also timed, in the same rounds, against a **bare floor**: the
same four calls, its grant a bare upsert of the register (:data:`BARE_GRANT_SQL`:
the draw, the same commit mode, none of the grant's catalog checks). The
target is set against that floor; the difference between the two floors is
what the grant's checks cost per cycle.

Then the token statement alone, on a raw autocommit psycopg connection,
interleaved: ``SELECT 1`` (a round trip), ``SELECT nextval(...),
txid_current()`` (the token statement before the lease register), the bare
upsert and the grant: what the register costs every lease, floor included.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import psycopg
import redis
import sqlalchemy as sa

import sa_fence
from sa_fence.cli.bench import (
    HandWritten,
    Op,
    Progress,
    Schema,
    Timing,
    fmt_time,
    grant_params,
    interleave,
    psycopg_conninfo,
    ratio_range,
    sa_fence_cycle,
)
from sa_fence.db import register as _register

from .common import Config, Target
from .flush import server_cpu

TTL = 30.0
TARGET = 1.05  # sa-fence / the bare floor
#: The token statement before the lease register (and the old floor's).
NEXTVAL_SQL = (
    "SELECT nextval(CAST(%(name)s AS regclass)), txid_current(), "
    "current_setting('synchronous_commit')"
)
FLOOR = "hand-written floor"
BARE_FLOOR = "bare floor"
ROUND_TRIP = "SELECT 1 (a round trip)"
NEXTVAL = "SELECT nextval(...), txid_current() (before)"
BARE = "a bare register upsert (no checks)"
GRANT = "the grant: checks + draw + register"
#: The bare floor's grant: the token drawn and the register advanced as the grant does, and
#: committed as it is (``{commit_mode}``: the grant's own clause, no WAL flush while the WAL is
#: flushed past the draw), with none of its checks: the sequence's settings, the register's
#: token default, the lock wait bound.
BARE_GRANT_SQL = """\
WITH drawn AS (
    SELECT pg_catalog.nextval(CAST(%(sequence)s AS pg_catalog.regclass)) AS token,
           pg_catalog.current_setting('synchronous_commit') AS synchronous_commit
{commit_mode})
INSERT INTO {register} AS r (name, token, granted_at)
SELECT %(name)s, m.token, pg_catalog.clock_timestamp() FROM commit_mode m
ON CONFLICT (name) DO UPDATE
   SET token = EXCLUDED.token, granted_at = EXCLUDED.granted_at, previous = r.token
 WHERE r.token < EXCLUDED.token
RETURNING r.token, (SELECT d.synchronous_commit FROM drawn d)"""
# From per-phase timings and a run with Redis and PostgreSQL stubbed.
WHY_LEASE = (
    "sa-fence's own Python per cycle is ~10 us with the servers stubbed (the floor's: 1 us): "
    "argument checks, the Lease object and its state, the renewer bookkeeping on release. "
    "The rest is spread over the four server calls, each a few us heavier than the floor's "
    "(timed per phase: ACQUIRE, a Lua script that answers 'already ours' on a resend, +3-9 us "
    "over a bare SET NX PX; CONFIRM +3 us; the grant +13-18 us, with the token path's lock, "
    "fork and recycle checks; its SQL text is built once per register). The grant's WAL "
    "flush, when its commit waits for one, moves by tens of us from cycle to cycle"
)


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


def bare_grant_sql(schema: Schema) -> str:
    """:data:`BARE_GRANT_SQL` for the benchmark's register (same parameters as the grant),
    with the grant's own ``commit_mode`` clause."""
    grant = _register.grant_function_sql()  # (the grant runs it in its SECURITY DEFINER function)
    commit_mode = grant[grant.index("), commit_mode AS (") : grant.index("), granted AS (")]
    commit_mode = commit_mode.replace("grant_skip_flush", "CAST(%(skip_flush)s AS boolean)")
    return BARE_GRANT_SQL.format(register=schema.register.table_sql, commit_mode=commit_mode)


def token_statements(
    conninfo: str, schema: Schema, config: Config, progress: Progress
) -> tuple[dict[str, Timing], dict[str, float] | None]:
    """``SELECT 1``, the old ``nextval`` statement, the bare upsert and the grant, raw
    psycopg, interleaved; then the server backend's CPU per bare upsert and per grant
    (:func:`~tests.benchmarks.flush.server_cpu`).

    The bare upsert and the grant are committed with their WAL flush forced
    (``skip_flush`` off): interleaved, the one that follows the other's
    asynchronous commit would otherwise pay that commit's flush every time.
    """
    grant = schema.register.grant_sql
    bare = bare_grant_sql(schema)
    params = grant_params(schema.sequence, "statements", skip_flush=False)
    old = {"name": schema.register.sequence_sql}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        timings = interleave(
            {
                ROUND_TRIP: Op(lambda: conn.execute("SELECT 1").fetchone()),
                NEXTVAL: Op(lambda: conn.execute(NEXTVAL_SQL, old).fetchone()),
                BARE: Op(lambda: conn.execute(bare, params).fetchone()),
                GRANT: Op(lambda: conn.execute(grant, params).fetchone()),
            },
            rounds=config.rounds,
            per_round=2 if config.quick else 100,
            progress=progress,
            label="lease cycle: the token statement",
        )
        cpu = server_cpu(
            {
                BARE: (conn, Op(lambda: conn.execute(bare, params).fetchone())),
                GRANT: (conn, Op(lambda: conn.execute(grant, params).fetchone())),
            },
            2 if config.quick else 1000,
        )
    return timings, cpu


def run(
    fencer: sa_fence.Fencer,
    client: redis.Redis,
    url: sa.URL,
    schema: Schema,
    config: Config,
    progress: Progress,
) -> tuple[
    dict[str, tuple[Timing, Timing]], list[str], dict[str, Timing], dict[str, float] | None, Timing
]:
    """{contender: (its timing, the floor's timing in the same run)}, notes, the token
    statements' timings and server CPU (:func:`token_statements`), and the bare floor's
    timing, taken in sa-fence's rounds.

    Each contender is interleaved with the hand-written floor alone, one pair
    after the other, so every "x floor" is a clean pairwise ratio.  (All six
    in one rotation disturb each other: pottery starts a thread pool per
    acquire, whose threads still run while the next contender is timed, and
    on two cores that slowed every other contender by 25-45%.)
    """
    conninfo = psycopg_conninfo(url)
    ops, notes, pg = peers(client, conninfo, f"{fencer.key_prefix}peer")
    floor = HandWritten.beside(fencer, url, f"{fencer.key_prefix}floor")
    bare = HandWritten.beside(
        fencer, url, f"{fencer.key_prefix}bare-floor", grant_sql=bare_grant_sql(schema)
    )
    contenders = {"sa-fence": Op(sa_fence_cycle(fencer, "cycle")), **ops}
    pairs: dict[str, tuple[Timing, Timing]] = {}
    bare_timing = Timing()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pottery warns about a single master
            for name, op in contenders.items():
                timed = {name: op, FLOOR: Op(floor.cycle)}
                if name == "sa-fence":
                    timed[BARE_FLOOR] = Op(bare.cycle)
                timings = interleave(
                    timed,
                    rounds=config.rounds,
                    per_round=2 if config.quick else 50,
                    progress=progress,
                    label=f"lease cycle: {name} vs floor",
                )
                pairs[name] = (timings[name], timings[FLOOR])
                bare_timing = timings.get(BARE_FLOOR, bare_timing)
    finally:
        floor.close()
        bare.close()
        pg.close()
    timings, cpu = token_statements(conninfo, schema, config, progress)
    return pairs, notes, timings, cpu, bare_timing


def report(
    pairs: dict[str, tuple[Timing, Timing]],
    notes: list[str],
    statements: dict[str, Timing],
    cpu: dict[str, float] | None,
    bare: Timing,
) -> list[Target]:
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
    print(
        "  (the floor issues a token too: SET NX PX, the same grant statement, "
        "owner-checked confirm+release)"
    )
    for note in notes:
        print(f"  ({note})")
    timing, floor = pairs["sa-fence"]
    low, high = ratio_range(timing, bare)
    bare_ratio = timing.median / bare.median
    checks = floor.median - bare.median
    print(
        f"{'sa-fence, x the bare floor':<28}{fmt_time(timing.median):>11}"
        f"{fmt_time(bare.median):>17}{bare_ratio:>9.3f}x{f'{low:.2f}-{high:.2f}x':>18}  yes"
    )
    print(
        "  (the bare floor, timed in sa-fence's rounds: the same four calls, its grant a bare "
        "register upsert committed the same way;\n   the grant's checks cost "
        f"{checks * 1e6:+.1f} us per cycle: the floor minus the bare floor)"
    )
    n = len(statements[GRANT].samples)
    print(f"the token statement alone (raw psycopg, autocommit, interleaved, median of {n} each)")
    trip, nextval, upsert, grant = (
        statements[k].median for k in (ROUND_TRIP, NEXTVAL, BARE, GRANT)
    )
    for label, value, note in (
        (ROUND_TRIP, trip, ""),
        (NEXTVAL, nextval, f"{(nextval - trip) * 1e6:+7.1f} us over a round trip"),
        (BARE, upsert, f"{(upsert - nextval) * 1e6:+7.1f} us over nextval"),
        (GRANT, grant, f"{(grant - upsert) * 1e6:+7.1f} us over the bare upsert: its checks"),
    ):
        print(f"  {label:<46}{fmt_time(value):>11}  {note}".rstrip())
    print(
        "  (these two with their WAL flush forced, alike; in a lease cycle a grant skips it "
        "when the WAL is already flushed past the draw,\n   never when the draw itself was "
        "WAL-logged: nextval logs one value in 32; docs/guarantees.md)"
    )
    if cpu is not None:
        print("the same two, server backend CPU per statement (schedstat), median of 1000 each")
        print(f"  {BARE:<46}{fmt_time(cpu[BARE]):>11}")
        print(
            f"  {GRANT:<46}{fmt_time(cpu[GRANT]):>11}  "
            f"{(cpu[GRANT] - cpu[BARE]) * 1e6:+7.1f} us: the checks' server work"
        )
    why = (
        f"{(timing.median - bare.median) * 1e6:.0f} us over a bare floor of "
        f"{bare.median * 1e6:.0f} us, of which the grant's checks {checks * 1e6:.0f} us "
        f"(the floor with the grant itself: {floor.median * 1e6:.0f} us, sa-fence "
        f"{timing.median / floor.median:.3f}x it): {WHY_LEASE}. See docs/benchmarks.md"
    )
    return [Target("lease cycle", bare_ratio, TARGET, "x bare floor", why)]
