"""Flush: a fenced ORM write next to a plain one and to ``version_id_col``.

Three tables of the same shape (``id``, ``payload``, ``counter`` and a bigint
column), one per contender (:func:`sa_fence.cli.bench.make_schema`):

* ``plain``: a plain ``sessionmaker``, no sa-fence;
* ``fenced``: ``sa_fence.install(sessionmaker(...))`` with a lease bound to
  every session (the table uses the ``Fenced`` mixin), lease scope on: every
  commit carries the register check
  (:meth:`~sa_fence.cli.bench.FlushBench.verify_lease_scope` proves it first);
* ``version_id_col``: SQLAlchemy's own optimistic check, for comparison.

Operations, each timed interleaved op by op (plain, fenced, version_id_col,
plain, ...), the order rotated every round:

* update: load ``n`` rows, change a column on each, commit (n = 1, 10, 100,
  1000; the targets are on 1 and 1000; the plot shows all four);
* delete: load ``n`` rows, delete each, commit (n = 1 and 1000; the rows are
  put back untimed before every op).

Then it counts the statements one flush of 1000 rows sends, and measures
where the fenced 1-row update's extra time goes (:func:`run_breakdown`):
the op plain, fenced, and fenced with lease scope skipped (no arm, no
trigger: a diagnostic variant, never a setting), alternated, each op's wall
time split into this process's CPU (ours), the server backends' CPU and the
waiting left over (:func:`op_costs`); the mechanism's SQL alone on raw
psycopg connections after a 1-row UPDATE: COMMIT, ``SELECT 1; COMMIT``, the
client-sent check of before issue 19 (``SELECT sa_fence_check_lease(...);
COMMIT``) and today's arm in the BEGIN message with the deferred trigger at
COMMIT, side by side; and this process's and the server's CPU time for one
flush of all the changed rows, plain and fenced (:func:`flush_cpu`: what
sa-fence adds per row, free of the waiting).  The accounts printed under a
missed target are built from those numbers.
"""

from __future__ import annotations

import gc
import statistics
import time
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.orm import Session

from sa_fence.cli.bench import (
    FlushBench,
    Op,
    Progress,
    Timing,
    fmt_time,
    interleave,
    psycopg_conninfo,
    ratio_range,
)
from sa_fence.db import guard as _guard
from sa_fence.scope import arming

from .common import Config, Target

VARIANTS = ("plain", "fenced", "version_id_col")
TARGET = 1.05  # fenced / plain, per-op median, 1 row (update and delete)
TARGET_MANY = 1.03  # the same at the many-row size (1000 rows)
# The parts of the account that come from profiles (pyinstrument, 3000 fenced
# 1-row ops) rather than from this run's own breakdown.
WHY_HOOKS = (
    "sa-fence's session listeners and its connection steps (the statement rewrite and row "
    "count check, the arm, the COMMIT), its flush and commit spans and the lease's validity "
    "checks: how the token reaches the ORM's own batched UPDATE (calls section: where the "
    "calls go)"
)
#: Above this much fenced Python per flushed row (seconds), the account names its cause.
PER_ROW_NOTICE = 1e-6
WHY_PER_ROW = (
    "profiled, sa-fence's steps for each row (the check that no fence was assigned, over the "
    "flushed objects; the token put in each parameter set; each written object shown its "
    "token) and SQLAlchemy and psycopg carrying one more parameter a row (0.1 calls a row "
    "over plain, calls section)"
)
WHY_SERVER_ROW = (
    "writing each row's fence, its fenced condition, coalesce(fence, 0) <= the token, and the "
    "set_config() that presents the token to a guard in the same statement (a GUC set per "
    "row); in raw SQL on this server, each of the fence write and the set_config is about a "
    "quarter of it (docs/benchmarks.md)"
)
WHY_CHECK = (
    "the transaction's BEGIN message carries the arm, `BEGIN; INSERT INTO sa_fence_scope "
    "...` (no extra round trip): the server parses, plans and runs a second statement in "
    "that message, the INSERT of one row into an UNLOGGED table with no index, and at "
    "COMMIT the deferred trigger calls its PL/pgSQL function, which looks up the register "
    "row, takes its share lock (a WAL record) and deletes the scope row by its ctid"
)


@dataclass
class FlushResult:
    update: dict[int, dict[str, Timing]] = field(default_factory=dict)
    delete: dict[int, dict[str, Timing]] = field(default_factory=dict)
    counts: dict[str, FlushCount] = field(default_factory=dict)
    scope: str = ""  # the lease scope line (verified before anything is timed)
    breakdown: Breakdown | None = None


@dataclass
class Breakdown:
    """Where the fenced 1-row update's extra time goes (see run_breakdown)."""

    op: dict[str, OpCost]  # plain / fenced, lease scope skipped / fenced (see op_costs)
    sql: dict[str, Timing]  # raw psycopg: COMMIT / SELECT 1; COMMIT / check; COMMIT
    rows: int = 0  # rows changed per flush in the CPU measurement
    cpu: dict[str, list[float]] = field(default_factory=dict)  # plain / fenced: flush CPU s
    #: plain / fenced: the server backend's CPU during the same flushes (seconds); empty when
    #: the server does not run on this machine
    flush_server: dict[str, list[float]] = field(default_factory=dict)
    #: the raw SQL lines' median server backend CPU per transaction (seconds); None when
    #: the server does not run on this machine
    sql_server: dict[str, float] | None = None

    def ours(self) -> float:
        """The fenced 1-row transaction's extra CPU time in this process (seconds)."""
        return self.op["fenced"].median("cpu") - self.op["plain"].median("cpu")

    def server_op(self) -> tuple[float, float] | None:
        """The server backends' extra CPU inside the 1-row op (seconds): the row fence
        (lease scope skipped over plain) and lease scope (fenced over skipped); None when
        the server does not run on this machine."""
        if not self.op["plain"].server:
            return None
        plain, skipped, fenced = (self.op[v].median("server") for v in OP_VARIANTS)
        return skipped - plain, fenced - skipped

    def per_row(self) -> tuple[float, float, float]:
        """Median flush CPU time, plain and fenced, and the fenced extra per row (seconds)."""
        plain, fenced = (statistics.median(self.cpu[v]) for v in ("plain", "fenced"))
        return plain, fenced, (fenced - plain) / max(self.rows, 1)

    def server_per_row(self) -> tuple[float, float, float] | None:
        """The same for the server backend's CPU during those flushes; None if unmeasured."""
        if not self.flush_server.get("plain"):
            return None
        plain, fenced = (statistics.median(self.flush_server[v]) for v in ("plain", "fenced"))
        return plain, fenced, (fenced - plain) / max(self.rows, 1)

    def extra(self) -> tuple[float, float, float, float]:
        """(hooks, register check in the op, second statement, the check itself), seconds."""
        op = {k: cost.median("wall") for k, cost in self.op.items()}
        sql = {k: t.median for k, t in self.sql.items()}
        return (
            op[SKIPPED] - op["plain"],
            op["fenced"] - op[SKIPPED],
            sql[SELECT_1] - sql[COMMIT],
            sql[CHECK] - sql[SELECT_1],
        )


@dataclass
class OpCost:
    """One variant of the 1-row update + commit, per op (seconds): wall time, this process's
    CPU and the server backends' CPU (empty when the server runs elsewhere)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    server: list[float] = field(default_factory=list)

    def median(self, kind: str) -> float:
        samples: list[float] = getattr(self, kind)
        return statistics.median(samples)

    def waiting(self) -> float | None:
        """The median of what each op spent in neither CPU: the network, the WAL flush, other
        processes on the machine; None when the server's CPU was not measured."""
        if not self.server:
            return None
        return statistics.median(
            w - c - s for w, c, s in zip(self.wall, self.cpu, self.server, strict=True)
        )


@dataclass
class FlushCount:
    statements: int = 0
    updates: int = 0  # cursor executions of an UPDATE (an executemany counts once)
    update_param_sets: int = 0
    sql: str = ""


def count_flush(bench: FlushBench, variant: str, n: int) -> FlushCount:
    """The statements the flush of one op sends (counted on the bench's own engine)."""
    counted = FlushCount()
    active = False

    def before_cursor_execute(
        conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        if not active:
            return
        counted.statements += 1
        if statement.lstrip().upper().startswith("UPDATE"):
            counted.updates += 1
            counted.update_param_sets += len(parameters) if executemany else 1
            counted.sql = " ".join(statement.split())

    def flush_counted(session: Session) -> None:
        nonlocal active
        active = True
        try:
            session.flush()
        finally:
            active = False

    sa.event.listen(bench.engine, "before_cursor_execute", before_cursor_execute)
    try:
        bench.update(variant, n, before_commit=flush_counted)
    finally:
        sa.event.remove(bench.engine, "before_cursor_execute", before_cursor_execute)
    return counted


SKIPPED = "fenced, lease scope skipped"
COMMIT = "COMMIT"
SELECT_1 = "SELECT 1; COMMIT"
#: The mechanism before issue 19: the check sent by the client with COMMIT.
CHECK = "SELECT sa_fence_check_lease(...); COMMIT"
#: Today's: the arm in the BEGIN message, the deferred trigger at COMMIT.
ARMED = "BEGIN; INSERT INTO sa_fence_scope ...; COMMIT (trigger)"


def run_breakdown(bench: FlushBench, config: Config, progress: Progress) -> Breakdown:
    """The fenced 1-row update with and without the register check, and the check's SQL.

    The variant without the check flushes, then drops the connection's lease
    scope (sa-fence's private per-connection record, which every fenced
    statement renews) just before the commit, so its COMMIT is the driver's
    own; the fenced op runs the same flush and ``session.connection()`` call
    without dropping it.  Diagnostic only: a bound session always checks.
    """
    op = op_costs(bench, config, progress)
    lease = bench.lease
    # (a benchmark line of the client-sent check of before: one simple-query message, so the
    # name is a literal here; sa-fence itself never writes a lease name into SQL)
    name = _guard.quote_literal(lease.name)
    check = f"SELECT {bench.schema.register.function_sql}({name}, {int(lease.token)})"
    table = bench.schema.models["plain"].__table__
    update = f'UPDATE "{table.schema}"."{table.name}" SET counter = counter + 1 WHERE id = %s'
    scope_table = bench.schema.register.scope_sql
    arm_row = arming._arm_row(lease)
    with (
        psycopg.connect(psycopg_conninfo(bench.engine.url)) as conn,
        psycopg.connect(psycopg_conninfo(bench.engine.url)) as armed,
    ):
        # sa-fence's own BEGIN on the second connection: every BEGIN carries the arm.
        # The arm goes out only while its owner (a Connection in lease scope) lives: a
        # stand-in owner in scope, kept alive for the block.
        owner = _ScopeOwner()
        vars(owner)[arming.SCOPE] = {(lease.name, lease.token): lease}
        vars(armed)[arming._ARMS] = ((str(scope_table), (arm_row,)),)
        vars(armed)[arming._ARMS_OWNER] = weakref.ref(owner)
        armed._start_query = types.MethodType(arming._start_query_armed, armed)  # type: ignore[method-assign]
        # the first statement begins the transaction, whose BEGIN carries the arm's row
        scoped = armed.execute(f"SELECT count(*) FROM {scope_table}").fetchone()
        armed.rollback()
        if scoped is None or scoped[0] < 1:
            raise RuntimeError("the armed BEGIN carried no arm: this line would measure nothing")
        serial = 0

        def commit_with(message: str | None, on: psycopg.Connection[Any] = conn) -> Op:
            def run() -> None:
                nonlocal serial
                serial += 1
                on.execute(update, (1 + serial % bench.rows,))
                if message is not None:
                    on.execute(message)  # no parameters: one simple-query message
                on.commit()  # nothing left to commit after a message with COMMIT

            return Op(run)

        raw = {
            COMMIT: (conn, commit_with(None)),
            SELECT_1: (conn, commit_with("SELECT 1; COMMIT")),
            CHECK: (conn, commit_with(f"{check}; COMMIT")),
            ARMED: (armed, commit_with(None, armed)),
        }
        per_round = 2 if config.quick else 100
        sql = interleave(
            {label: op for label, (_, op) in raw.items()},
            rounds=config.rounds,
            per_round=per_round,
            progress=progress,
            label="flush: the register check in SQL",
        )
        sql_server = server_cpu(raw, config.rounds * per_round)
    cpu, server = flush_cpu(bench, config, progress)
    return Breakdown(
        op=op, sql=sql, rows=bench.rows, cpu=cpu, flush_server=server, sql_server=sql_server
    )


class _ScopeOwner:
    """Stands in for the Connection whose lease scope an armed BEGIN belongs to."""


#: The 1-row update variants of the breakdown: plain, fenced with lease scope skipped (the
#: hooks and the row fence alone: a diagnostic, never a setting), fenced.
OP_VARIANTS = ("plain", SKIPPED, "fenced")


def _keep(session: Session) -> None:
    session.flush()
    session.connection()


def _skip(session: Session) -> None:
    session.flush()
    if session.connection().__dict__.pop(arming.SCOPE, None) is None:  # scope ends
        raise RuntimeError("no lease scope to skip: the breakdown would measure nothing")


def run_variant(bench: FlushBench, variant: str) -> None:
    """One 1-row update + commit of ``variant``; the fenced ones run the same flush and
    ``session.connection()`` call, the skipped one drops its lease scope before COMMIT
    and sends no arm."""
    if variant == "plain":
        bench.update("plain", 1)
    elif variant == "fenced":
        bench.update("fenced", 1, before_commit=_keep)
    else:
        arm = arming._arm
        arming._arm = lambda conn, lease: None  # type: ignore[assignment]
        try:
            bench.update("fenced", 1, before_commit=_skip)
        finally:
            arming._arm = arm  # type: ignore[assignment]


def backend_cpu(pid: int) -> float | None:
    """CPU seconds server backend ``pid`` has run (the kernel's schedstat, nanoseconds);
    None when no PostgreSQL process of that pid runs on this machine."""
    try:
        with open(f"/proc/{pid}/comm", encoding="ascii") as comm:
            if not comm.read().startswith("postgres"):
                return None
        with open(f"/proc/{pid}/schedstat", encoding="ascii") as stat:
            return int(stat.read().split()[0]) / 1e9
    except (OSError, ValueError):
        return None


def server_cpu(
    raw: dict[str, tuple[psycopg.Connection[Any], Op]], ops: int
) -> dict[str, float] | None:
    """The median server backend CPU per op of each raw SQL line, in a pass of its own
    (untimed, interleaved): the server's share of each mechanism, which another load on
    the machine leaves mostly alone (it adds waiting, not CPU).  Raw SQL, not the ORM op:
    nothing of the client's runs between the two readings but the op's own statements."""
    cpu: dict[str, list[float]] = {label: [] for label in raw}
    for i in range(ops):
        labels = list(raw) if i % 2 == 0 else list(reversed(raw))
        for label in labels:
            conn, op = raw[label]
            pid = conn.info.backend_pid
            before = backend_cpu(pid)
            op.run()
            after = backend_cpu(pid)
            if before is None or after is None:
                return None
            cpu[label].append(after - before)
    return {label: statistics.median(times) for label, times in cpu.items()}


def client_backends(engine: sa.Engine) -> list[int]:
    """The pids of the server backends serving the bench's database: the engine's pooled
    connections (the bench's database is its own, so no one else's backend is among them)."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT pid FROM pg_catalog.pg_stat_activity"
                    " WHERE datname = pg_catalog.current_database()"
                    " AND backend_type = 'client backend'"
                )
            ).scalars()
        )


def backends_cpu(pids: list[int]) -> float | None:
    """The CPU seconds the backends ``pids`` have run, together; None when one of them does
    not run on this machine."""
    total = 0.0
    for pid in pids:
        cpu = backend_cpu(pid)
        if cpu is None:
            return None
        total += cpu
    return total


def op_costs(bench: FlushBench, config: Config, progress: Progress) -> dict[str, OpCost]:
    """The 1-row update + commit of each of :data:`OP_VARIANTS`, alternated op by op (the
    order rotated every round, garbage collection between rounds only, one warm-up round):
    per op, its wall time, this process's CPU time and the server backends' CPU time.

    What is neither CPU is waiting: the network, the WAL flush, other processes on the
    machine.  The server's CPU is read inside the ORM op itself, not from the same SQL sent
    alone, because there it costs more: the client's Python runs on the same cores between
    its statements.  Skipping lease scope (a diagnostic) parts the server's share in two:
    the row fence (the fenced UPDATE) and lease scope (the arm and the trigger at COMMIT).
    """
    rounds, per = (1, 2) if config.quick else (config.rounds, 40)
    costs = {v: OpCost() for v in OP_VARIANTS}
    for v in OP_VARIANTS:  # the pool's connections exist before their backends are listed
        run_variant(bench, v)
    pids = client_backends(bench.engine)
    on_server = True
    progress.start("flush: where the 1-row time goes", rounds + 1)
    for r in range(rounds + 1):  # round 0 warms up
        k = r % len(OP_VARIANTS)
        order = OP_VARIANTS[k:] + OP_VARIANTS[:k]
        gc.collect()
        gc.disable()
        try:
            for _ in range(per):
                for v in order:
                    server = backends_cpu(pids)
                    cpu, wall = time.process_time(), time.perf_counter()
                    run_variant(bench, v)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    after = backends_cpu(pids)
                    if server is None or after is None:
                        on_server = False  # the server runs elsewhere (or a backend left)
                    if r:
                        costs[v].wall.append(wall)
                        costs[v].cpu.append(cpu)
                        costs[v].server.append(
                            0.0 if server is None or after is None else after - server
                        )
        finally:
            gc.enable()
        progress.step()
    progress.finish()
    if not on_server:
        for cost in costs.values():
            cost.server.clear()
    return costs


def flush_cpu(
    bench: FlushBench, config: Config, progress: Progress
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """This process's CPU time for one flush of ``bench.rows`` changed rows, plain and fenced,
    and the server backend's during the same flush (none when the server runs elsewhere).

    CPU time, not wall time: it leaves out the wait, so sa-fence's per-row Python and the
    server's per-row work for the fenced statement show even on a loaded machine.
    Alternated plain / fenced, the order swapped every round, garbage collection off while a
    flush runs.
    """
    rounds, per = (1, 1) if config.quick else (config.rounds, 3)
    cpu: dict[str, list[float]] = {"plain": [], "fenced": []}
    server: dict[str, list[float]] = {"plain": [], "fenced": []}
    progress.start(f"flush: CPU time of a {bench.rows}-row flush", rounds)
    for r in range(rounds):
        for _ in range(per):
            for variant in ("plain", "fenced") if r % 2 == 0 else ("fenced", "plain"):
                model = bench.schema.models[variant]
                bench.serial += 1
                with bench.session(variant) as session:
                    items = session.scalars(sa.select(model).where(model.id <= bench.rows)).all()
                    for item in items:
                        item.payload = f"cpu {bench.serial}"
                    pid = session.connection().connection.dbapi_connection.info.backend_pid
                    gc.collect()
                    gc.disable()
                    try:
                        backend, started = backend_cpu(pid), time.process_time()
                        session.flush()
                        cpu[variant].append(time.process_time() - started)
                        after = backend_cpu(pid)
                    finally:
                        gc.enable()
                    if backend is not None and after is not None:
                        server[variant].append(after - backend)
                    session.commit()
        progress.step()
    progress.finish()
    return cpu, server


def per_round(n: int, config: Config) -> int:
    if config.quick:
        return 2
    return {1: 40, 10: 20, 100: 10}.get(n, 5)


def run(bench: FlushBench, config: Config, progress: Progress) -> FlushResult:
    result = FlushResult()
    rows = bench.rows
    sizes = sorted({1, 10, 100, rows} if rows >= 100 else {1, rows})
    result.scope = bench.verify_lease_scope()
    result.counts = {v: count_flush(bench, v, rows) for v in VARIANTS}
    for n in sizes:
        result.update[n] = interleave(
            bench.ops("update", n, VARIANTS),
            rounds=config.rounds,
            per_round=per_round(n, config),
            progress=progress,
            label=f"flush: update {n} row{'s' if n > 1 else ''}",
        )
    for n in sorted({1, rows}):
        result.delete[n] = interleave(
            bench.ops("delete", n, VARIANTS),
            rounds=config.rounds,
            per_round=per_round(n, config),
            progress=progress,
            label=f"flush: delete {n} row{'s' if n > 1 else ''}",
        )
    result.breakdown = run_breakdown(bench, config, progress)
    return result


def why_missed(
    result: FlushResult, n: int, ratio: float, plain: float, kind: str = "update"
) -> str:
    """The account printed under a missed flush target, with this run's own numbers."""
    b = result.breakdown
    if b is None:
        return ""
    hooks, check, second, body = b.extra()
    base = b.op["plain"].median("wall")
    us = 1e6
    if n == 1:
        head = (
            f"{(ratio - 1) * plain * us:.0f} us over plain per transaction, with no extra "
            "round trip (the flush sends what plain sends; the BEGIN message carries the "
            "arm). "
        )
        if b.server_op() is not None:
            return head + cpu_account(b)
        return head + (
            f"This run's breakdown of the same op: the lease register check "
            f"{check * us:.0f} us, {check / base * 100:.1f}% of a plain op by itself: "
            f"{WHY_CHECK}; in raw SQL a second statement in the COMMIT message costs "
            f"{second * us:.0f} us and the check's own work {body * us:.0f} us. sa-fence's "
            f"hooks {hooks * us:.0f} us: {WHY_HOOKS}. Of the whole difference, this "
            f"process's CPU time (ours) is {b.ours() * us:.0f} us per transaction; the rest "
            "is the server's work and the wait for it. See docs/benchmarks.md"
        )
    constant = (
        f"the per-transaction constant of the 1-row case (hooks {hooks * us:.0f} us + register "
        f"check {check * us:.0f} us in this run's breakdown) is "
        f"{(hooks + check) / plain * 100:.1f}% of this op"
    )
    if kind == "delete":  # the per-row CPU is measured for the update only
        return constant + ". Whatever is left over is noise: see the per-round range"
    cpu_plain, cpu_fenced, per_row = b.per_row()
    grows = (cpu_fenced - cpu_plain) / plain * 100
    return (
        f"the per-transaction constant of the 1-row case (hooks {hooks * us:.0f} us + register "
        f"check {check * us:.0f} us in this run's breakdown) is "
        f"{(hooks + check) / plain * 100:.1f}% of this op. The fenced flush sends the one "
        f"statement plain sends, but its Python costs {per_row * us:.1f} us more per row "
        f"(flush CPU time {cpu_fenced * 1e3:.1f} ms against {cpu_plain * 1e3:.1f} ms: "
        f"{grows:.1f}% of this op)"
        + (f": {WHY_PER_ROW}" if per_row > PER_ROW_NOTICE else "")
        + server_row_account(b, plain)
        + ". Whatever is left over is noise: see the per-round range"
    )


def server_row_account(b: Breakdown, plain: float) -> str:
    """The server's share of the per-row difference, from its backend's CPU; "" if unmeasured."""
    rows = b.server_per_row()
    if rows is None:
        return ""
    server_plain, server_fenced, per_row = rows
    return (
        f"; the server's work {per_row * 1e6:.1f} us more per row (backend CPU "
        f"{server_fenced * 1e3:.1f} ms against {server_plain * 1e3:.1f} ms: "
        f"{(server_fenced - server_plain) / plain * 100:.1f}% of this op): {WHY_SERVER_ROW}"
    )


def cpu_account(b: Breakdown) -> str:
    """The 1-row account from the breakdown's own ops: this process's CPU (ours), the server
    backends' CPU (the row fence's and lease scope's) and the waiting left over."""
    server = b.server_op()
    assert server is not None
    fence, scope = server
    us = 1e6
    base = b.op["plain"].median("wall")
    over = b.op["fenced"].median("wall") - base
    waits = [b.op[v].waiting() for v in ("plain", "fenced")]
    waiting = (waits[1] or 0.0) - (waits[0] or 0.0)
    alone = ""
    if b.sql_server is not None:
        raw = b.sql_server[ARMED] - b.sql_server[COMMIT]
        alone = (
            f" (the same SQL sent alone on a raw connection: {raw * us:+.0f} us; inside the op "
            "the client's Python runs on the same cores between its statements)"
        )
    return (
        f"In this run's breakdown (the 1-row update alternated with plain, {over * us:+.0f} us "
        f"over it): this process's CPU (ours) {b.ours() * us:+.0f} us per transaction "
        f"({WHY_HOOKS}); the server's CPU {(fence + scope) * us:+.0f} us, of which the row "
        f"fence {fence * us:+.0f} us (writing the fence, its condition and the set_config() "
        f"that presents the token) and lease scope {scope * us:+.0f} us{alone}: {WHY_CHECK}. "
        f"Lease scope's server work is {scope / base * 100:.1f}% of the plain op it was "
        f"measured beside ({base * 1e3:.2f} ms) by itself. Waiting (the network, the WAL "
        f"flush, the other processes on the machine) {waiting * us:+.0f} us. See "
        "docs/benchmarks.md"
    )


def report(result: FlushResult, rows: int) -> list[Target]:
    """Print the tables; return the targets with their outcome."""
    targets: list[Target] = []
    print(f"\n{result.scope}")
    print(
        f"{'flush (load + change/delete + commit)':<40}{'plain':>11}{'fenced':>11}"
        f"{'version_id_col':>16}{'fenced/plain':>14}{'per-round range':>18}{'vid/plain':>11}"
    )
    for kind, table in (("update", result.update), ("delete", result.delete)):
        for n, timings in table.items():
            med = {v: timings[v].median for v in VARIANTS}
            ratio = med["fenced"] / med["plain"]
            low, high = ratio_range(timings["fenced"], timings["plain"])
            label = f"{kind} {n} row{'s' if n > 1 else ''}"
            print(
                f"{label:<40}{fmt_time(med['plain']):>11}{fmt_time(med['fenced']):>11}"
                f"{fmt_time(med['version_id_col']):>16}{ratio:>13.3f}x"
                f"{f'{low:.2f}-{high:.2f}x':>18}{med['version_id_col'] / med['plain']:>10.2f}x"
            )
            if n in (1, rows):
                targets.append(
                    Target(
                        f"fenced {kind}+commit, {label.split(' ', 1)[1]}",
                        ratio,
                        TARGET if n == 1 else TARGET_MANY,
                        "x plain",
                        why_missed(result, n, ratio, med["plain"], kind),
                    )
                )
    counts = result.counts
    print(f"\nstatements sent by one flush of {rows} changed rows")
    print(f"{'':<36}{'plain':>8}{'fenced':>8}{'version_id_col':>16}")
    for label, attr in (
        ("all statements", "statements"),
        ("UPDATE cursor executions", "updates"),
        ("UPDATE parameter sets", "update_param_sets"),
    ):
        values = [getattr(counts[v], attr) for v in VARIANTS]
        print(f"{label:<36}{values[0]:>8}{values[1]:>8}{values[2]:>16}")
    print(f"  fenced UPDATE: {counts['fenced'].sql}")
    if result.breakdown is not None:
        report_breakdown(result.breakdown)
    return targets


def _cells(values: tuple[float | None, ...], delta: bool) -> list[str]:
    return [
        "-" if v is None else (f"{v * 1e6:+.1f} us" if delta else fmt_time(v).strip())
        for v in values
    ]


def report_breakdown(b: Breakdown) -> None:
    _, _, second, body = b.extra()
    n = len(b.op["plain"].wall)
    print(f"\nwhere the fenced 1-row update's time goes (alternated op by op, median of {n} each)")
    print(
        f"  {'':<46}{'wall':>11}{'this process':>14}{'server CPU':>13}{'waiting':>11}\n"
        f"  {'':<46}{'':>11}{'CPU (ours)':>14}{'(schedstat)':>13}"
    )
    measured = bool(b.op["plain"].server)
    medians = {
        v: (
            cost.median("wall"),
            cost.median("cpu"),
            cost.median("server") if measured else None,
            cost.waiting(),
        )
        for v, cost in b.op.items()
    }
    rows: list[tuple[str, tuple[float | None, ...], bool]] = [
        ("plain session", medians["plain"], False),
        (f"{SKIPPED} (diagnostic)", medians[SKIPPED], False),
        ("fenced (lease scope on)", medians["fenced"], False),
    ]
    for low, high, label in (
        ("plain", SKIPPED, "skipped over plain: the hooks, the row fence"),
        (SKIPPED, "fenced", "fenced over skipped: lease scope"),
        ("plain", "fenced", "fenced over plain"),
    ):
        pairs = zip(medians[low], medians[high], strict=True)
        rows.append(
            (label, tuple(None if x is None or y is None else y - x for x, y in pairs), True)
        )
    for label, values, delta in rows:
        wall, cpu, server, waiting = _cells(values, delta)
        print(f"  {label:<46}{wall:>11}{cpu:>14}{server:>13}{waiting:>11}")
    n = len(b.sql[COMMIT].samples)
    print(f"the register check in SQL: raw psycopg, 1-row UPDATE then ..., median of {n} each")
    rows = (
        (COMMIT, b.sql[COMMIT], ""),
        (SELECT_1, b.sql[SELECT_1], f"{second * 1e6:+7.1f} us  a second statement"),
        (CHECK, b.sql[CHECK], f"{body * 1e6:+7.1f} us  the check's own work (before)"),
        (
            ARMED,
            b.sql[ARMED],
            f"{(b.sql[ARMED].median - b.sql[COMMIT].median) * 1e6:+7.1f} us  over COMMIT (now)",
        ),
    )
    for label, timing, note in rows:
        print(f"  {label:<48}{fmt_time(timing.median):>11}  {note}".rstrip())
    if b.sql_server is not None:
        server = b.sql_server
        print(f"the same, server backend CPU per transaction (schedstat), median of {n} each")
        for label in (COMMIT, SELECT_1, CHECK, ARMED):
            extra = (server[label] - server[COMMIT]) * 1e6
            note = f"{extra:+7.1f} us" if label != COMMIT else ""
            print(f"  {label:<48}{fmt_time(server[label]):>11}  {note}".rstrip())
    cpu_plain, cpu_fenced, per_row = b.per_row()
    n = len(b.cpu["plain"])
    print(f"flush CPU time of this process, {b.rows} changed rows, median of {n} each")
    print(f"  {'plain':<48}{fmt_time(cpu_plain):>11}")
    print(f"  {'fenced':<48}{fmt_time(cpu_fenced):>11}  {per_row * 1e6:+7.2f} us per row")
    server_rows = b.server_per_row()
    if server_rows is not None:
        plain_server, fenced_server, server_row = server_rows
        print(f"the same flushes, server backend CPU (schedstat), median of {n} each")
        print(f"  {'plain':<48}{fmt_time(plain_server):>11}")
        print(f"  {'fenced':<48}{fmt_time(fenced_server):>11}  {server_row * 1e6:+7.2f} us per row")


def curve(result: FlushResult) -> dict[str, list[tuple[int, float]]]:
    """Median update+commit time per row count, per contender (for the plot)."""
    return {
        v: [(n, timings[v].median) for n, timings in sorted(result.update.items())]
        for v in VARIANTS
    }
