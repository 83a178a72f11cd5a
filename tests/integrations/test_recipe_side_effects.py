"""The side-effects recipe (docs/recipes/side_effects.py) as its users run it.

In a database of its own: the queue's tables are created with procrastinate's
own command, the worker is procrastinate's own ``worker`` command in a
process of its own, and the receiver is the recipe's WSGI app on loopback,
deduplicating on the ``Idempotency-Key`` in a table.  The Alembic revision
(docs/recipes/side_effects_migration.py) is run up, down and up again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
import redis
import sqlalchemy as sa

import sa_fence
from sa_fence.testing import expire
from tests._fresh_db import fresh_database
from tests._pg_cluster import wait_until_caught
from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "docs" / "recipes"
PROCRASTINATE = Path(sys.executable).parent / "procrastinate"
TIMEOUT = 60.0

pytestmark = pytest.mark.slow


def _env(engine: sa.Engine, prefix: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": engine.url.render_as_string(hide_password=False),
        "REDIS_URL": REDIS_URL,
        "SA_FENCE_KEY_PREFIX": prefix,
        "PYTHONPATH": str(RECIPES),
    }


def _load(name: str, env: dict[str, str]) -> ModuleType:
    saved = {k: os.environ.get(k) for k in ("DATABASE_URL", "REDIS_URL", "SA_FENCE_KEY_PREFIX")}
    os.environ.update({k: env[k] for k in saved})
    try:
        spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its annotations are resolved through it
        spec.loader.exec_module(module)
        return module
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _procrastinate(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(
        [str(PROCRASTINATE), "--app=side_effects.app", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def recipe() -> Iterator[tuple[ModuleType, dict[str, str], str]]:
    """The recipe on a fresh database (queue tables by `procrastinate schema --apply`),
    and the URL of its receiver."""
    prefix = f"sa_fence_recipe_se:{uuid.uuid4().hex[:8]}:"
    with fresh_database("recipe_se") as engine:
        env = _env(engine, prefix)
        module = _load("side_effects", env)
        module.create_tables()  # as the page says, before the queue's tables
        _procrastinate(env, "schema", "--apply")
        with module.engine.begin() as conn:
            conn.execute(sa.insert(module.Job).values(id=1, result=None, fence=0))
        server = make_server(
            "127.0.0.1", 0, module.make_receiver(module.engine), handler_class=_Quiet
        )
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield module, env, f"http://127.0.0.1:{server.server_port}/webhooks"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=TIMEOUT)
            module.fencer.close()
            module.engine.dispose()
            sys.modules.pop(module.__name__, None)
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=prefix + "*"):
                client.delete(key)
            client.close()


def _receipts(module: ModuleType) -> list[tuple[str, str]]:
    with module.engine.connect() as conn:
        rows = conn.execute(
            sa.select(module.receipts.c.idempotency_key, module.receipts.c.result)
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def _post(url: str, key: str | None, payload: dict[str, Any]) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_current_holders_webhook_is_delivered_and_a_repeat_is_not_applied(recipe):
    module, env, url = recipe
    key = module.finish(1, "done", url)
    _procrastinate(env, "worker", "--one-shot")
    assert _receipts(module) == [(key, "done")]

    # a retry of the same delivery (the worker died before it heard the answer)
    assert _post(url, key, {"job": 1, "result": "done"}) == 200
    assert _receipts(module) == [(key, "done")]
    assert _post(url, None, {"job": 1, "result": "done"}) == 400


def test_the_stale_holders_webhook_never_leaves(recipe):
    module, env, url = recipe
    a = module.fencer.acquire("job:1", ttl=30)
    with module.Session() as session:
        a.bind(session)
        session.get_one(module.Job, 1).result = "A"
        sa_fence.side_effect(session, module.notify, webhook_url=url, job_id=1, result="A")
        expire(a)  # A pauses past its TTL; B finishes the job
        key_b = module.finish(1, "B", url)
        with pytest.raises(sa_fence.StaleTokenError):
            session.commit()
    _procrastinate(env, "worker", "--one-shot")
    assert _receipts(module) == [(key_b, "B")]


def test_the_worker_command_stops_cleanly_on_sigterm(recipe):
    module, env, _ = recipe
    proc = subprocess.Popen(
        [str(PROCRASTINATE), "--app=side_effects.app", "worker"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        with module.engine.connect() as conn:
            while not conn.scalar(sa.text("SELECT count(*) FROM procrastinate_workers")):
                assert time.monotonic() < deadline, "the worker never registered"
                assert proc.poll() is None, f"the worker exited {proc.returncode}"
                conn.rollback()
                time.sleep(0.1)
        # registered is not yet listening for SIGTERM: under load the signal could still
        # meet Python's default action and kill the worker (-15) before its handler is set
        wait_until_caught(proc.pid, signal.SIGTERM, TIMEOUT)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
    with module.engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM procrastinate_workers")) == 0


def _procrastinate_objects(conn: sa.Connection) -> int:
    return int(
        conn.scalar(
            sa.text(
                "SELECT (SELECT count(*) FROM pg_class WHERE relname LIKE 'procrastinate%')"
                " + (SELECT count(*) FROM pg_proc WHERE proname LIKE 'procrastinate%')"
                " + (SELECT count(*) FROM pg_type WHERE typname LIKE 'procrastinate%')"
            )
        )
    )


def test_the_alembic_revision_creates_the_queue_and_its_downgrade_removes_it():
    from alembic.migration import MigrationContext
    from alembic.operations import Operations

    spec = importlib.util.spec_from_file_location(
        "recipe_side_effects_migration", RECIPES / "side_effects_migration.py"
    )
    assert spec is not None
    assert spec.loader is not None
    revision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revision)

    def run(step: str) -> None:
        with engine.begin() as conn, Operations.context(MigrationContext.configure(conn)):
            getattr(revision, step)()

    with fresh_database("recipe_se_alembic") as engine:
        run("upgrade")
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT count(*) FROM procrastinate_jobs")) == 0
            assert _procrastinate_objects(conn) > 0
        run("downgrade")
        with engine.connect() as conn:
            assert _procrastinate_objects(conn) == 0
        run("upgrade")  # and again: the downgrade left nothing in the way
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT count(*) FROM procrastinate_jobs")) == 0
