"""Running the harness: private servers, proxies, worker processes, the nemesis.

:func:`chaos_environment` starts what a run breaks: a private PostgreSQL
cluster (``wal_level = logical``, so a ``test_decoding`` slot records the
commit order), a private ``redis-server`` on a fixed port (restarted in
place by the nemesis), and a TCP proxy in front of each, through which the
workers connect.  Everything is stopped and removed when the block ends.
:func:`run` then does one run in a fresh database: spawn the workers, let
the nemesis loose, wait for the workers (bounded by operations and time),
heal everything, read the commit stream and the final tables, and check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

from tests._pg_cluster import PgCluster, private_cluster
from tests._redis_server import free_port
from tests._tcp_proxy import TcpProxy
from tests.chaos import checker
from tests.chaos.nemesis import DEFAULT_FAULTS, Nemesis
from tests.chaos.schema import Base, Row
from tests.chaos.worker import WorkerConfig
from tests.chaos.worker import main as worker_main

SLOT = "chaos_commits"


class ChaosRedis:
    """A private redis-server on a fixed port, killed and restarted in place."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        self.binary = binary
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                *(self.binary, "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.02)
        client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def flushall(self) -> None:
        client = self.client()
        try:
            client.flushall()  # our own server: nobody else's data
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class ChaosEnv:
    pg: PgCluster
    redis: ChaosRedis
    pg_proxy: TcpProxy
    redis_proxy: TcpProxy
    folder: Path
    database: str = ""
    ttl: float = 0.5
    worker_pids: list[int] = field(default_factory=list)
    worker_states: list[Any] = field(default_factory=list)
    #: for other topologies (issue 10's Sentinel failover): what their faults need
    extra: dict[str, Any] = field(default_factory=dict)

    def heal(self) -> None:
        """Undo whatever a fault left behind: traffic flows, servers run, workers run."""
        self.pg_proxy.heal()
        self.redis_proxy.heal()
        if not self.pg.running():
            self.pg.start()
        if not self.redis.running():
            self.redis.start()
        for pid in self.worker_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextmanager
def chaos_environment() -> Iterator[ChaosEnv]:
    folder = Path(tempfile.mkdtemp(prefix="sa_fence_chaos_"))
    redis_server = ChaosRedis()
    try:
        with private_cluster(
            "chaos", wal_level="logical", max_replication_slots=8, max_connections=120
        ) as pg:
            redis_server.start()
            with (
                TcpProxy(("127.0.0.1", pg.port), name="pg") as pg_proxy,
                TcpProxy(("127.0.0.1", redis_server.port), name="redis") as redis_proxy,
            ):
                yield ChaosEnv(pg, redis_server, pg_proxy, redis_proxy, folder)
    finally:
        redis_server.kill()
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class ChaosConfig:
    workers: int = 4
    ops: int = 10_000
    max_seconds: float = 180.0
    rows: int = 4
    ttl: float = 0.5
    fenced: bool = True
    seed: int = 1
    fault_interval: float = 1.0
    faults: tuple[str, ...] = DEFAULT_FAULTS
    think_ms: float = 5.0
    #: end the run once the nemesis went round every enabled kind this often
    #: (None: run to ``ops`` or ``max_seconds``)
    fault_cycles: int | None = None
    #: with ``fault_cycles``: end the run only once the workers also committed this
    #: many units of work (acknowledged), so that a slow machine does the same work
    #: in more time; ``max_seconds`` still bounds the run
    min_ok: int = 0
    #: the workers' Redis client for another topology (see WorkerConfig)
    redis_factory: str | None = None
    #: fenced runs: False leaves the row fence alone (no register check at COMMIT)
    lease_scope: bool = True


@dataclass
class ChaosResult:
    config: ChaosConfig
    seconds: float
    attempts: list[dict[str, Any]]
    faults: list[checker.FaultWindow]
    check: checker.CheckResult
    nemesis_errors: list[str]
    #: every committed transaction, in commit order (from the WAL)
    commits: list[checker.Transaction]

    @property
    def transactions(self) -> int:
        return len(self.commits)

    def save(self, folder: Path) -> Path:
        """Write the history (attempts, faults, commits, anomalies) as JSON lines."""
        mode = "fenced" if self.config.fenced else "unfenced"
        if self.config.fenced and not self.config.lease_scope:
            mode = "row-fence-only"
        target = folder / f"chaos-{mode}-seed{self.config.seed}"
        target.mkdir(parents=True, exist_ok=True)
        with open(target / "attempts.jsonl", "w") as out:
            out.writelines(json.dumps(a) + "\n" for a in self.attempts)
        with open(target / "faults.jsonl", "w") as out:
            out.writelines(json.dumps(dataclasses.asdict(f)) + "\n" for f in self.faults)
        with open(target / "commits.jsonl", "w") as out:
            out.writelines(json.dumps(dataclasses.asdict(c)) + "\n" for c in self.commits)
        with open(target / "anomalies.jsonl", "w") as out:
            out.writelines(json.dumps(dataclasses.asdict(a)) + "\n" for a in self.anomalies)
        (target / "report.txt").write_text(self.report() + "\n")
        return target

    @property
    def anomalies(self) -> list[checker.Anomaly]:
        return self.check.anomalies

    def outcomes(self) -> Counter[str]:
        return Counter(a["outcome"] for a in self.attempts)

    def report(self) -> str:
        config = self.config
        if not config.fenced:
            mode = "UNFENCED (plain sessions: no lease scope, no row fence)"
        elif not config.lease_scope:
            mode = "ROW FENCE ONLY (lease scope off)"
        else:
            mode = "fenced (lease scope and row fence on)"
        lines = [
            f"chaos run, {mode}: {config.workers} workers, {config.rows} rows, "
            f"ttl {config.ttl:g} s, seed {config.seed}, {self.seconds:.1f} s",
        ]
        outcomes = self.outcomes()
        shown = ", ".join(f"{k} {v}" for k, v in outcomes.most_common())
        lines.append(f"  operations: {len(self.attempts)} ({shown})")
        if self.check.unknown_total:
            lines.append(
                f"  outcome unknown (COMMIT failed): {self.check.unknown_total}, of which "
                f"{self.check.unknown_committed} turned out committed"
            )
        lines.append(f"  committed transactions in the WAL: {self.transactions}")
        faults = Counter(f.kind for f in self.faults)
        lines.append(
            f"  faults: {len(self.faults)} ("
            + ", ".join(f"{k} {v}" for k, v in sorted(faults.items()))
            + ")"
        )
        if self.nemesis_errors:
            lines.append(f"  nemesis errors: {len(self.nemesis_errors)}: {self.nemesis_errors[:3]}")
        by_kind = self.check.by_kind()
        if by_kind:
            lines.append(
                f"  ANOMALIES: {len(self.anomalies)} ("
                + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items()))
                + ")"
            )
            seen: set[str] = set()
            for anomaly in self.anomalies:
                if anomaly.kind not in seen:
                    seen.add(anomaly.kind)
                    lines.append(f"    e.g. {anomaly.kind}: {anomaly.detail}")
        else:
            lines.append("  anomalies: none")
        lines.append("  availability (committed / operations begun during the fault):")
        table = checker.availability(self.attempts, self.faults)
        for kind in ["none", *sorted(k for k in table if k != "none")]:
            if kind in table:
                ok, total = table[kind]
                share = f"{100 * ok / total:5.1f}%" if total else "    -"
                lines.append(f"    {kind:17} {share}  ({ok}/{total})")
        return "\n".join(lines)


def _prepare(env: ChaosEnv, config: ChaosConfig, label: str) -> str:
    database = f"chaos_{label}_{os.getpid()}_{int(time.time() * 1000) % 100000}"
    env.pg.create_database(database)
    engine = sa.create_engine(env.pg.url(database), poolclass=sa.pool.NullPool)
    try:
        Base.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(sa.insert(Row), [{"id": i, "value": 0} for i in range(1, config.rows + 1)])
        with engine.connect() as conn:
            conn.execute(
                sa.text("SELECT pg_create_logical_replication_slot(:slot, 'test_decoding')"),
                {"slot": f"{SLOT}_{database}"[:63]},
            )
            conn.commit()
    finally:
        engine.dispose()
    return database


def _commit_stream(env: ChaosEnv, database: str) -> list[checker.Transaction]:
    engine = sa.create_engine(env.pg.url(database), poolclass=sa.pool.NullPool)
    slot = f"{SLOT}_{database}"[:63]
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT lsn::text, data FROM pg_logical_slot_get_changes(:slot, NULL, "
                    "NULL, 'include-xids', '1', 'skip-empty-xacts', '1')"
                ),
                {"slot": slot},
            )
            transactions = checker.parse_decoding((lsn, data) for lsn, data in rows)
            conn.execute(sa.text("SELECT pg_drop_replication_slot(:slot)"), {"slot": slot})
            conn.commit()
    finally:
        engine.dispose()
    return transactions


def _final_state(env: ChaosEnv, database: str) -> dict[str, Any]:
    engine = sa.create_engine(env.pg.url(database), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return {
                "audit": list(conn.execute(sa.text("SELECT uow FROM chaos_audit")).scalars()),
                "items": list(conn.execute(sa.text("SELECT uow FROM chaos_items")).scalars()),
                "rows": {
                    row.id: (row.value, row.fence)
                    for row in conn.execute(sa.text("SELECT id, value, fence FROM chaos_rows"))
                },
            }
    finally:
        engine.dispose()


def run(
    env: ChaosEnv,
    config: ChaosConfig,
    *,
    progress: Callable[[str], None] | None = None,
) -> ChaosResult:
    """One run in a fresh database of ``env``'s cluster; returns the checked result."""
    say = progress or (lambda message: None)
    label = "fenced" if config.fenced else "unfenced"
    env.heal()
    env.ttl = config.ttl
    database = env.database = _prepare(env, config, label)
    context = multiprocessing.get_context("spawn")
    histories = [env.folder / f"{database}-w{i}.jsonl" for i in range(config.workers)]
    started = time.time()
    deadline = started + config.max_seconds
    per_worker = -(-config.ops // config.workers)
    states = [context.Value("i", 0) for _ in range(config.workers)]
    committed = [context.Value("i", 0) for _ in range(config.workers)]
    stop = context.Event()
    processes = []
    for i in range(config.workers):
        worker_config = WorkerConfig(
            worker=i,
            pg_url=env.pg.url(database)
            .set(port=env.pg_proxy.port)
            .render_as_string(hide_password=False),
            redis_port=env.redis_proxy.port,
            key_prefix=f"chaos:{database}:",
            history=str(histories[i]),
            ops=per_worker,
            deadline=deadline,
            rows=config.rows,
            ttl=config.ttl,
            fenced=config.fenced,
            seed=config.seed * 1000 + i,
            think_ms=config.think_ms,
            redis_factory=config.redis_factory,
            lease_scope=config.lease_scope,
        )
        process = context.Process(
            target=worker_main,
            args=(worker_config.to_json(), states[i], stop, committed[i]),
            daemon=True,
        )
        process.start()
        processes.append(process)
    env.worker_pids = [p.pid for p in processes if p.pid is not None]
    env.worker_states = states
    nemesis = Nemesis(env, config.faults, config.fault_interval, config.seed)
    nemesis.start()
    bound = f"up to {config.ops} operations or {config.max_seconds:g} s"
    say(f"{label}: {config.workers} workers, {bound}")
    try:
        while any(p.is_alive() for p in processes) and time.time() < deadline + 30:
            if (
                config.fault_cycles is not None
                and nemesis.cycles >= config.fault_cycles
                and sum(count.value for count in committed) >= config.min_ok
            ):
                stop.set()
            time.sleep(0.05)
        stop.set()
        for process in processes:
            process.join(timeout=max(1.0, deadline + 30 - time.time()))
    finally:
        nemesis.stop()
        env.heal()
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    seconds = time.time() - started
    exit_codes = [p.exitcode for p in processes]
    attempts = []
    for path in histories:
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line cut short by a kill
                    attempts.append(json.loads(line))
    if any(code != 0 for code in exit_codes):
        raise RuntimeError(f"chaos workers failed (exit codes {exit_codes}); see their stderr")
    say(f"{label}: {len(attempts)} operations in {seconds:.1f} s; checking")
    transactions = _commit_stream(env, database)
    final = _final_state(env, database)
    result = checker.check(attempts, transactions, final, rows=config.rows)
    return ChaosResult(
        config=config,
        seconds=seconds,
        attempts=attempts,
        faults=nemesis.windows,
        check=result,
        nemesis_errors=nemesis.errors,
        commits=transactions,
    )
