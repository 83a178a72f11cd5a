"""The Celery recipe (docs/recipes/celery_tasks.py) under real ``celery worker``
processes, with a private redis-server as broker, result backend and lease
store: results, skips and errors through the result backend, the send-time
argument check, and a stalled worker whose task is redelivered (acks_late)
and whose late write is refused."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import sa_fence
from sa_fence.testing import pause, resume
from tests._redis_server import RedisServer, private_redis

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "docs" / "recipes"
STARTUP = 30.0


class Worker:
    """One ``celery worker`` process (solo pool: the task runs in the process we pause)."""

    def __init__(self, name: str, env: dict[str, str], queue: str = "celery") -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "celery_tasks", "worker",
                "--pool=solo", "-n", f"{name}@localhost", "--without-gossip",
                "--without-mingle", "--without-heartbeat",
                "-I", "tests.recipes.celery_extra_tasks", "-Q", queue, "--loglevel=INFO",
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited:\n{self.log}")
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {self.name}: no {text!r} in {timeout} s:\n{self.log}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, 18)  # SIGCONT, in case it is paused
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)


def worker_env(database_url: sa.URL, server: RedisServer, **extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join([str(RECIPES), str(ROOT)])
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SA_FENCE_", "CELERY_"))},
        "PYTHONPATH": pythonpath,
        "DATABASE_URL": database_url.render_as_string(hide_password=False),
        "REDIS_URL": f"redis://127.0.0.1:{server.port}/0",
        "SA_FENCE_KEY_PREFIX": f"celery_recipe:{uuid.uuid4().hex[:8]}:",
        **extra,
    }


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    with private_redis() as server:
        yield server


@pytest.fixture(scope="module")
def recipe(
    database_url: sa.URL, engine: sa.Engine, broker: RedisServer
) -> Iterator[tuple[ModuleType, dict[str, str]]]:
    """The recipe module as a client imports it, and the environment its workers get."""
    env = worker_env(database_url, broker)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path.insert(0, str(RECIPES))
    try:
        module = importlib.import_module("celery_tasks")
        module.create_tables()
        yield module, env
    finally:
        module = sys.modules.pop("celery_tasks", None)
        if module is not None:
            module.fencer.close()
            module.engine.dispose()
            module.app.close()
        sys.path.remove(str(RECIPES))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def worker(recipe: tuple[ModuleType, dict[str, str]]) -> Iterator[Worker]:
    _, env = recipe
    w = Worker("results", env)
    try:
        w.wait_for("ready.", STARTUP)
        yield w
    finally:
        w.stop()


def row(engine: sa.Engine, job_id: int) -> tuple[Any, ...] | None:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT result, fence FROM celery_jobs WHERE id = :id"), {"id": job_id}
        ).one_or_none()
    return None if found is None else tuple(found)


def test_a_task_with_a_missing_argument_is_refused_when_sent_not_in_the_worker(
    recipe: tuple[ModuleType, dict[str, str]],
) -> None:
    module, _ = recipe
    with pytest.raises(TypeError, match=r"missing a required argument|required positional"):
        module.finish_job.apply_async(args=[])


def test_results_skips_and_errors_come_back_through_the_result_backend(
    recipe: tuple[ModuleType, dict[str, str]], worker: Worker, engine: sa.Engine
) -> None:
    module, _ = recipe
    # a result: the token the job was written with
    token = module.finish_job.delay(1, "done").get(timeout=30)
    assert row(engine, 1) == ("done (by results@localhost)", token)

    # contention, on_busy="raise": the error, its class and attributes intact
    with module.fencer.acquire("job:2", ttl=30) as held:
        busy = module.finish_job.delay(2, "x")
        with pytest.raises(sa_fence.LeaseNotAcquiredError) as refused:
            busy.get(timeout=30)
        skipped = module.finish_job_unless_busy.delay(2, "x").get(timeout=30)
    assert refused.value.name == "job:2"
    assert refused.value.holder_token == held.token
    assert str(refused.value).count("job:2") == 1
    # on_busy="skip": JSON carries SKIPPED as its string value, equal to it
    assert skipped == sa_fence.SKIPPED
    assert row(engine, 2) is None

    # a stale write refused at the flush: StaleTokenError with its attributes
    with module.Session() as session, sa_fence.unfenced(session):
        session.add(module.Job(id=3, result="initial"))
        session.commit()
    with pytest.raises(sa_fence.StaleTokenError) as stale:
        module.app.send_task("tests.recipes.celery_extra_tasks.overtaken", args=[3]).get(timeout=30)
    newer_fence = row(engine, 3)[1]  # type: ignore[index]
    assert stale.value.table == "celery_jobs"
    assert stale.value.primary_keys == ((3,),)
    assert stale.value.current_fences == (newer_fence,)
    assert stale.value.token < newer_fence
    assert row(engine, 3) == ("by the newer holder", newer_fence)


def test_a_stalled_workers_redelivered_task_stands_and_its_late_write_is_refused(
    recipe: tuple[ModuleType, dict[str, str]], engine: sa.Engine, broker: RedisServer
) -> None:
    """acks_late + a visibility timeout shorter than the stall: the task runs twice."""
    module, env = recipe
    env = {**env, "JOB_TTL": "1", "VISIBILITY_TIMEOUT": "2"}
    leases = redis.Redis(port=broker.port)
    key = env["SA_FENCE_KEY_PREFIX"] + "job:7"
    a = Worker("A", env, queue="stall")  # not the module's other worker's queue
    b: Worker | None = None
    try:
        a.wait_for("ready.", STARTUP)
        result = module.finish_job.apply_async((7, "result"), {"work_seconds": 2.0}, queue="stall")
        deadline = time.monotonic() + 20
        while not leases.exists(key):  # A has taken the lease and is working
            assert time.monotonic() < deadline, a.log
            time.sleep(0.02)
        pause(a.proc)  # A stalls mid-work: its lease expires, its message is not acked
        b = Worker("B", env, queue="stall")
        b.wait_for("ready.", STARTUP)
        token_b = result.get(timeout=30)  # B ran the redelivered task
        assert row(engine, 7) == ("result (by B@localhost)", token_b)
        resume(a.proc)  # A wakes up and tries to write its stale result
        a.wait_for("raised unexpected", 30)
        assert "LeaseLostError" in a.log or "StaleTokenError" in a.log, a.log
        # B's write stands, in the database and in the result backend
        assert row(engine, 7) == ("result (by B@localhost)", token_b)
        assert result.state == "SUCCESS"
        assert module.app.AsyncResult(result.id).get(timeout=5) == token_b
    finally:
        a.stop()
        if b is not None:
            b.stop()
        leases.close()
