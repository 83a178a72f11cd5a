"""One chaos worker process: units of work under leases, every attempt recorded.

Each operation picks a row, takes its lease ``row:<id>`` (blocking, bounded),
and runs one unit of work in a session: ``rmw`` reads the row, waits a few
milliseconds, writes ``value + 1``, inserts an item and an audit line;
``insert`` (one in five) inserts the item and the audit line only, so only
lease scope (the register check at COMMIT) can refuse it when stale.  The
flush is sent first, then the commit, so that the outcome is known exactly:

``ok``          the commit returned: acknowledged
``stale``       StaleTokenError (row fence at the flush or register check at
                COMMIT): nothing committed
``lost``        LeaseLostError before anything was sent: nothing committed
``failed``      the flush failed (connection lost, server gone): the
                transaction was never committed
``unknown``     the COMMIT itself failed: it may or may not have committed
``busy``        the lease was held by another worker the whole wait
``acquire-failed``  Redis or PostgreSQL failed during the acquire

One JSON line per attempt goes to the worker's history file, written and
flushed before the next attempt begins.  ``state`` (shared with the parent)
says when the worker holds a lease and has read its row but not yet sent its
COMMIT, so the nemesis can freeze it exactly then; ``committed`` (shared too)
counts the ``ok`` attempts, so the parent can run until enough work was done.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

IDLE, HOLDING, READ = 0, 1, 2


@dataclass
class WorkerConfig:
    worker: int
    pg_url: str
    redis_port: int
    key_prefix: str
    history: str
    ops: int
    deadline: float  # wall clock (time.time())
    rows: int
    ttl: float
    fenced: bool
    seed: int
    think_ms: float = 5.0
    #: "module:function" making the worker's Redis client from this config (another
    #: topology, e.g. Sentinel); None: a plain client on ``redis_port``
    redis_factory: str | None = None
    #: fenced runs only: False switches lease scope off (the row fence alone)
    lease_scope: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def main(config_json: str, state: Any, stop: Any, committed: Any = None) -> None:
    """Entry point in the child (multiprocessing, spawn)."""
    # Lost leases, unbound leases (unfenced runs), servers going away: expected
    # here, and recorded as outcomes; the log would only drown the figures.
    logging.getLogger("sa_fence").setLevel(logging.CRITICAL)
    config = WorkerConfig(**json.loads(config_json))
    Worker(config, state, stop, committed).run()


class Worker:
    def __init__(self, config: WorkerConfig, state: Any, stop: Any, committed: Any = None) -> None:
        import redis
        import sqlalchemy as sa
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        from sqlalchemy.orm import sessionmaker

        import sa_fence
        from tests.chaos.schema import SEQUENCE

        self.config = config
        self.state = state
        self.stop = stop
        self.committed = committed
        self.rng = random.Random(config.seed)
        self.engine = sa.create_engine(
            config.pg_url,
            pool_size=2,
            # bounded waits: a cut or crashed server fails an operation, never hangs it
            connect_args={"connect_timeout": 3, "options": "-c statement_timeout=15000"},
        )
        if config.redis_factory:
            module, _, function = config.redis_factory.partition(":")
            self.redis = getattr(importlib.import_module(module), function)(config)
        else:
            self.redis = redis.Redis(
                host="127.0.0.1",
                port=config.redis_port,
                socket_timeout=0.5,
                socket_connect_timeout=0.5,
                retry=Retry(NoBackoff(), 0),  # sa-fence resends, within its budget
            )
        self.fencer = sa_fence.Fencer(
            self.redis, self.engine, sequence=SEQUENCE, key_prefix=config.key_prefix, timeout=2.0
        )
        if config.fenced and not config.lease_scope:
            # the comparison at COMMIT switched off: each COMMIT goes out unchecked
            from sa_fence.scope import arming

            def commit_unchecked(conn: Any) -> None:
                conn.__dict__.pop(arming.SCOPE, None)  # the scope ends, unchecked

            arming.check_scope_and_commit = commit_unchecked
        maker = sessionmaker(self.engine)
        self.make_session = sa_fence.install(maker) if config.fenced else maker
        self.history = open(config.history, "a", buffering=1)  # noqa: SIM115 (closed in run)

    def run(self) -> None:
        try:
            op = 0
            while (
                op < self.config.ops
                and time.time() < self.config.deadline
                and not self.stop.is_set()
            ):
                op += 1
                record = self.attempt(op)
                self.history.write(json.dumps(record) + "\n")
                self.history.flush()
                if record["outcome"] == "ok" and self.committed is not None:
                    self.committed.value += 1  # after the line is written: the parent counts it
                if record["outcome"] in ("acquire-failed", "failed", "unknown"):
                    time.sleep(0.02)  # a server is down: do not spin
        finally:
            self.history.close()
            self.fencer.close()
            self.engine.dispose()
            self.redis.close()

    def attempt(self, op: int) -> dict[str, Any]:
        import sqlalchemy as sa

        import sa_fence

        config = self.config
        row_id = self.rng.randint(1, config.rows)
        kind = "insert" if self.rng.random() < 0.2 else "rmw"
        name = f"row:{row_id}"
        uow = f"{config.worker}-{op}"
        record: dict[str, Any] = {
            "worker": config.worker,
            "op": op,
            "uow": uow,
            "kind": kind,
            "name": name,
            "row": row_id,
            "token": None,
            "t0": time.time(),
        }
        try:
            lease = self.fencer.acquire(name, config.ttl, blocking=True, timeout=config.ttl)
        except sa_fence.LeaseNotAcquiredError:
            return self._done(record, "busy")
        except (sa_fence.FenceError, sa.exc.SQLAlchemyError, OSError) as exc:
            return self._done(record, "acquire-failed", exc)
        record["token"] = lease.token
        record["t_granted"] = time.time()
        self.state.value = HOLDING
        try:
            return self._unit_of_work(record, lease, kind, row_id, uow, op)
        finally:
            self.state.value = IDLE
            with contextlib.suppress(sa_fence.FenceError):  # Redis down: the TTL ends it
                lease.release()

    def _unit_of_work(
        self, record: dict[str, Any], lease: Any, kind: str, row_id: int, uow: str, op: int
    ) -> dict[str, Any]:
        import sqlalchemy as sa

        import sa_fence
        from tests.chaos.schema import Audit, Item, Row

        config = self.config
        session = self.make_session()
        try:
            if config.fenced:
                lease.bind(session)
            read_value = new_value = None
            try:
                if kind == "rmw":
                    row = session.get_one(Row, row_id)
                    read_value = row.value
                    self.state.value = READ
                    time.sleep(self.rng.random() * config.think_ms / 1000)
                    new_value = read_value + 1
                    row.value = new_value
                    if not config.fenced:
                        row.fence = lease.token  # recorded, never compared
                else:
                    self.state.value = READ
                    time.sleep(self.rng.random() * config.think_ms / 1000)
                item = Item(row_id=row_id, uow=uow)
                if not config.fenced:
                    item.fence = lease.token
                session.add(item)
                session.add(
                    Audit(
                        uow=uow,
                        kind=kind,
                        worker=config.worker,
                        op=op,
                        name=lease.name,
                        token=lease.token,
                        row_id=row_id,
                        read_value=read_value,
                        new_value=new_value,
                    )
                )
                record["read"] = read_value
                session.flush()
            except sa_fence.StaleTokenError as exc:
                return self._done(record, "stale", exc)
            except sa_fence.LeaseLostError as exc:
                return self._done(record, "lost", exc)
            except (sa.exc.SQLAlchemyError, sa_fence.FenceError, OSError) as exc:
                return self._done(record, "failed", exc)
            self.state.value = HOLDING  # from here on a pause changes nothing it sent
            try:
                session.commit()
            except sa_fence.StaleTokenError as exc:
                return self._done(record, "stale", exc)
            except sa_fence.LeaseLostError as exc:
                return self._done(record, "lost", exc)
            except (sa.exc.SQLAlchemyError, sa_fence.FenceError, OSError) as exc:
                return self._done(record, "unknown", exc)
            return self._done(record, "ok")
        finally:
            with contextlib.suppress(Exception):  # a dead connection: the pool drops it
                session.close()

    def _done(
        self, record: dict[str, Any], outcome: str, exc: BaseException | None = None
    ) -> dict[str, Any]:
        record["outcome"] = outcome
        record["t1"] = time.time()
        if exc is not None:
            first = (str(exc).splitlines() or [""])[0]
            record["error"] = f"{type(exc).__name__}: {first[:160]}"
        return record
