"""The integration recipes in docs/recipes/ (each the code block of its page,
run as written from a fresh venv by tests/project/test_pages.py), imported and
exercised here against real PostgreSQL and Redis: FastAPI (a dependency yielding a
fenced session, through TestClient), Flask-SQLAlchemy, SQLModel, scoped_session
and a cron-style script.  The Celery recipe has its own module
(tests/integrations/test_recipe_celery.py): it needs worker processes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import sa_fence
from sa_fence.testing import expire
from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "docs" / "recipes"
PREFIX = f"sa_fence_recipes:{uuid.uuid4().hex[:8]}:"


def recipe_env(database_url: sa.URL) -> dict[str, str]:
    return {
        "DATABASE_URL": database_url.render_as_string(hide_password=False),
        "REDIS_URL": REDIS_URL,
        "SA_FENCE_KEY_PREFIX": PREFIX,
    }


@pytest.fixture(scope="module")
def load(database_url: sa.URL, engine: sa.Engine) -> Iterator[Any]:
    """Import a recipe file as its users would, configured for the test run."""
    env = recipe_env(database_url)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    loaded: dict[str, ModuleType] = {}

    def load_recipe(name: str) -> ModuleType:
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
            assert spec is not None
            assert spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    try:
        yield load_recipe
    finally:
        for module in loaded.values():
            fencer = getattr(module, "fencer", None)
            if fencer is not None:
                fencer.close()
            eng = getattr(module, "engine", None)
            if isinstance(eng, sa.Engine):
                eng.dispose()
            sys.modules.pop(module.__name__, None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=PREFIX + "*"):
            client.delete(key)
        client.close()


def fence_of(engine: sa.Engine, table: str, key_column: str, key: Any) -> tuple[Any, ...] | None:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(f"SELECT * FROM {table} WHERE {key_column} = :key"), {"key": key}
        ).one_or_none()
    return None if found is None else tuple(found)


# -------------------------------------------------------------------- FastAPI


def test_fastapi_a_fenced_session_dependency_writes_with_the_token_and_answers_409(
    load: Any, engine: sa.Engine
) -> None:
    from fastapi.testclient import TestClient

    recipe = load("fastapi_app")
    with TestClient(recipe.app) as client:  # its lifespan creates the table
        done = client.put("/jobs/1", json={"result": "done"})
        assert done.status_code == 200, done.text
        body = done.json()
        assert body["result"] == "done"
        assert fence_of(engine, "api_jobs", "id", 1) == (1, "done", body["fence"])
        assert body["fence"] > 0  # the token, not the server default

        with recipe.fencer.acquire("job:1", ttl=30):  # another worker holds the job
            busy = client.put("/jobs/1", json={"result": "late"})
        assert busy.status_code == 409
        assert "being worked on elsewhere" in busy.json()["detail"]

        # A stale commit: the request's lease is overtaken after it was bound.
        def overtaken(job_id: int) -> Iterator[Any]:
            for session in recipe.fenced_job_session(job_id):
                lease = sa_fence.orm.session_state.state_of(session).lease
                expire(lease)  # the request "pauses" past its TTL...
                with recipe.fencer.acquire(f"job:{job_id}", ttl=30):  # ...and another came
                    pass
                yield session

        recipe.app.dependency_overrides[recipe.fenced_job_session] = overtaken
        try:
            stale = client.put("/jobs/1", json={"result": "stale"})
        finally:
            recipe.app.dependency_overrides.clear()
        assert stale.status_code == 409
        assert "commit refused" in stale.json()["detail"]
    assert fence_of(engine, "api_jobs", "id", 1)[1] == "done"  # type: ignore[index]


# ----------------------------------------------------------- Flask-SQLAlchemy


def test_flask_sqlalchemy_db_session_is_fenced_and_a_stale_commit_is_a_409(
    load: Any, engine: sa.Engine
) -> None:
    recipe = load("flask_app")
    app = recipe.create_app()  # creates the table
    client = app.test_client()
    done = client.put("/jobs/1", json={"result": "done"})
    assert done.status_code == 200, done.text
    assert fence_of(engine, "flask_jobs", "id", 1) == (1, "done", done.json["fence"])
    assert done.json["fence"] > 0

    fencer = app.extensions["sa_fence"]
    with fencer.acquire("job:1", ttl=30):
        assert client.put("/jobs/1", json={"result": "late"}).status_code == 409

    # Without a lease, db.session may not write fenced rows: the hook is on it.
    with app.app_context():
        recipe.db.session.add(recipe.Job(id=2, result="no lease"))
        with pytest.raises(sa_fence.UnfencedWriteError):
            recipe.db.session.commit()
        recipe.db.session.rollback()
    assert fence_of(engine, "flask_jobs", "id", 2) is None


# -------------------------------------------------------------------- SQLModel


def test_sqlmodel_a_table_model_with_the_fence_stores_the_token_on_insert_and_update(
    load: Any, engine: sa.Engine
) -> None:
    recipe = load("sqlmodel_models")
    recipe.create_tables()
    job = recipe.finish_job(1, "first")
    first = fence_of(engine, "sqlmodel_jobs", "id", 1)
    assert first == (1, "first", job.fence)  # the row carries the token
    assert job.fence > 0  # and the object shows it (not 0)
    again = recipe.finish_job(1, "second")
    assert again.fence > job.fence
    assert fence_of(engine, "sqlmodel_jobs", "id", 1) == (1, "second", again.fence)
    assert "fence" not in recipe.Job(result="x").model_dump()

    # a stale holder is refused
    stale = recipe.fencer.acquire("job:1", ttl=30)
    with recipe.Sessions() as session:
        stale.bind(session)
        session.get(recipe.Job, 1).result = "stale"
        expire(stale)
        recipe.finish_job(1, "newer")
        with pytest.raises(sa_fence.StaleTokenError):
            session.commit()
    assert fence_of(engine, "sqlmodel_jobs", "id", 1)[1] == "newer"  # type: ignore[index]


# -------------------------------------------------------------- scoped_session


def test_scoped_session_threads_each_write_on_their_own_session_under_each_jobs_lease(
    load: Any, engine: sa.Engine
) -> None:
    recipe = load("scoped")
    recipe.create_tables()
    tokens = recipe.work(list(range(1, 9)))
    assert len(set(tokens)) == 8
    for job_id, token in zip(range(1, 9), tokens, strict=True):
        assert fence_of(engine, "scoped_jobs", "id", job_id) == (job_id, f"result {job_id}", token)


# ------------------------------------------------------------------------ cron


def run_cron(database_url: sa.URL, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RECIPES / "cron_job.py"), *args],
        env={**os.environ, **recipe_env(database_url), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_a_cron_run_writes_its_report_and_an_overlapping_run_skips(
    load: Any, database_url: sa.URL, engine: sa.Engine
) -> None:
    recipe = load("cron_job")
    recipe.create_tables()
    first = run_cron(database_url, "2026-11-30")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("report 2026-11-30: written with token ")
    token = int(first.stdout.split()[-1])
    assert fence_of(engine, "cron_reports", "day", "2026-11-30")[-1] == token  # type: ignore[index]

    with recipe.fencer.acquire("report:2026-11-30", ttl=30):  # the previous run still works
        overlap = run_cron(database_url, "2026-11-30")
    assert overlap.returncode == 0, overlap.stderr
    assert overlap.stdout.strip() == "report 2026-11-30: another run is working on it; skipped"
    assert fence_of(engine, "cron_reports", "day", "2026-11-30")[-1] == token  # type: ignore[index]
