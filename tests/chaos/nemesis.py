"""The nemesis: one fault at a time, each injected, held for a while, then healed.

Faults are plain functions ``fault(env, rng) -> detail`` in :data:`FAULTS`,
keyed by kind; each returns only once it has healed what it broke.  The
schedule goes round the enabled kinds in a shuffled order, one fault every
``interval`` seconds, so a run of a few minutes sees every kind many times.

A hook for other topologies: Redis Sentinel failover (issue 10's topology
work) plugs in as one more entry, e.g.
``FAULTS["sentinel-failover"] = lambda env, rng: env.extra["sentinels"].failover()``,
with the servers it needs in ``ChaosEnv.extra`` and the workers' Redis
client made by ``ChaosConfig.redis_factory`` (``"module:function"``, called
in each worker with its :class:`~tests.chaos.worker.WorkerConfig`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from tests.chaos.checker import FaultWindow
from tests.chaos.worker import READ

if TYPE_CHECKING:
    from tests.chaos.run import ChaosEnv

Fault = Callable[["ChaosEnv", random.Random], str]


def _stopped(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True  # gone
    return state in ("T", "t")


def pause_worker(env: ChaosEnv, rng: random.Random) -> str:
    """SIGSTOP a worker that holds a lease and has read its row, past its TTL."""
    deadline = time.monotonic() + 1.0
    holding: list[int] = []
    while time.monotonic() < deadline:
        holding = [i for i, state in enumerate(env.worker_states) if state.value == READ]
        if holding:
            break
        time.sleep(0.002)
    index = rng.choice(holding) if holding else rng.randrange(len(env.worker_pids))
    pid = env.worker_pids[index]
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return f"worker {index} had already finished"
    for _ in range(1000):
        if _stopped(pid):
            break
        time.sleep(0.001)
    try:
        time.sleep(env.ttl * 2.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return f"worker {index} ({'holding a lease' if holding else 'idle'}) for {env.ttl * 2.5:g} s"


def redis_flush(env: ChaosEnv, rng: random.Random) -> str:
    env.redis.flushall()
    return "FLUSHALL (every lease gone)"


def redis_restart(env: ChaosEnv, rng: random.Random) -> str:
    env.redis.kill()
    time.sleep(0.2)
    env.redis.start()
    return "killed, down 0.2 s, restarted empty"


def pg_kill_backends(env: ChaosEnv, rng: random.Random) -> str:
    with psycopg.connect(env.pg.dsn(env.database), autocommit=True, connect_timeout=10) as conn:
        killed = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'"
        ).fetchone()
    return f"pg_terminate_backend x{killed[0] if killed else 0}"


def pg_crash(env: ChaosEnv, rng: random.Random) -> str:
    env.pg.crash()
    time.sleep(0.3)
    env.pg.start()
    return "immediate shutdown, down 0.3 s, crash recovery"


def _net(proxy_of: Callable[[ChaosEnv], object], action: str) -> Fault:
    def fault(env: ChaosEnv, rng: random.Random) -> str:
        proxy = proxy_of(env)
        if action == "delay":
            seconds = rng.uniform(0.01, 0.05)
            proxy.delay(seconds)  # type: ignore[attr-defined]
            time.sleep(1.0)
            detail = f"{seconds * 1000:.0f} ms per chunk for 1 s"
        else:
            proxy.cut()  # type: ignore[attr-defined]
            time.sleep(0.5)
            detail = "connections cut, new ones refused, 0.5 s"
        proxy.heal()  # type: ignore[attr-defined]
        return detail

    return fault


FAULTS: dict[str, Fault] = {
    "pause": pause_worker,
    "redis-flush": redis_flush,
    "redis-restart": redis_restart,
    "pg-kill-backends": pg_kill_backends,
    "pg-crash": pg_crash,
    "pg-net-delay": _net(lambda env: env.pg_proxy, "delay"),
    "pg-net-cut": _net(lambda env: env.pg_proxy, "cut"),
    "redis-net-delay": _net(lambda env: env.redis_proxy, "delay"),
    "redis-net-cut": _net(lambda env: env.redis_proxy, "cut"),
}
DEFAULT_FAULTS = tuple(FAULTS)


class Nemesis:
    def __init__(self, env: ChaosEnv, kinds: tuple[str, ...], interval: float, seed: int) -> None:
        unknown = set(kinds) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown fault kinds: {sorted(unknown)}")
        self.env = env
        self.kinds = kinds
        self.interval = interval
        self.rng = random.Random(seed)
        self.windows: list[FaultWindow] = []
        self.errors: list[str] = []
        #: full rounds of every enabled kind injected so far
        self.cycles = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nemesis", daemon=True)

    def start(self) -> None:
        if self.kinds:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def _run(self) -> None:
        order: list[str] = []
        while not self._stop.wait(self.interval * self.rng.uniform(0.5, 1.5)):
            if not order:
                order = list(self.kinds)
                self.rng.shuffle(order)
            kind = order.pop()
            start = time.time()
            try:
                detail = FAULTS[kind](self.env, self.rng)
            except Exception as exc:  # recorded; the run goes on
                detail = f"failed: {type(exc).__name__}: {exc}"
                self.errors.append(f"{kind}: {detail}")
            self.windows.append(FaultWindow(kind, start, time.time(), detail))
            if not order:
                self.cycles += 1
