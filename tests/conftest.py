"""Real PostgreSQL and Redis for every test; nothing is mocked.

Each run creates its own database (dropped at the end) and uses a Redis key
prefix unique to the run (its keys are deleted at the end; nothing is ever
flushed).  Point the suite elsewhere with SA_FENCE_TEST_PG (a SQLAlchemy URL
without a database name) and SA_FENCE_TEST_REDIS.
"""

from __future__ import annotations

import os
import shlex
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from tests.models import SEQUENCE, Base

PG_SERVER = os.environ.get("SA_FENCE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("SA_FENCE_TEST_REDIS", "redis://127.0.0.1:6379/0")
RUN_ID = uuid.uuid4().hex[:12]


def _admin_dsn() -> str:
    url = sa.make_url(PG_SERVER).set(database="postgres", drivername="postgresql")
    return url.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def database_url() -> Iterator[sa.URL]:
    """A fresh database for this test run, dropped afterwards."""
    name = f"sa_fence_test_{RUN_ID}"
    with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield sa.make_url(PG_SERVER).set(database=name)
    finally:
        with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def engine(database_url: sa.URL) -> Iterator[sa.Engine]:
    eng = sa.create_engine(database_url)
    Base.metadata.create_all(eng)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield client
    for key in client.scan_iter(match=f"sa_fence_test:{RUN_ID}:*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
def key_prefix() -> str:
    """A Redis key prefix no other test (or run) shares."""
    return f"sa_fence_test:{RUN_ID}:{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def fencer(redis_client: redis.Redis, engine: sa.Engine, key_prefix: str) -> sa_fence.Fencer:
    return sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)


@pytest.fixture
def make_session(engine: sa.Engine) -> sessionmaker[Session]:
    """A sessionmaker with the fenced-flush hook installed."""
    return sa_fence.install(sessionmaker(engine))


def _close_leftover_sessions() -> None:
    """Roll back and close every sync Session a test left open, even one whose assertion failed.

    Helpers such as ``run_seed_scenario`` hand their caller open sessions; a
    test failing before it closes one would leave a transaction holding row
    locks, and every later test would block until its timeout.  SQLAlchemy's
    ``close_all_sessions()`` would also close AsyncSessions' sync sessions,
    which needs a greenlet here, so this walks the same registry and skips
    them (the asyncio fixtures close their own).
    """
    from sqlalchemy.orm.session import _sessions  # the registry close_all_sessions() walks

    for session in list(_sessions.values()):
        if session.in_transaction() and not _is_async(session):
            session.close()


def _is_async(session: Session) -> bool:
    try:
        return bool(session.get_bind().dialect.is_async)
    except Exception:  # no bind to ask (binds= maps): an asyncio one would have one
        return False


@pytest.fixture(autouse=True)
def _clean_tables(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    _close_leftover_sessions()
    if "engine" in request.fixturenames:
        eng: sa.Engine = request.getfixturevalue("engine")
        with eng.begin() as conn:
            # A test that leaves a transaction open would block TRUNCATE forever:
            # fail loudly instead.  Never RESTART the token sequence.
            conn.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
            conn.execute(sa.text("TRUNCATE audit, cells, jobs"))


# The asyncio tests' fixtures (AsyncEngine, redis.asyncio client, AsyncFencer);
# the built wheel in fresh venvs (tests/project/test_packaging.py, tests/project/test_pages.py).
pytest_plugins = ("tests._async_fixtures", "tests._fresh_venv")


#: The test files that take longest (wall time: most of it waiting for private servers and
#: worker processes), longest first.  pytest-xdist hands a worker a file at a time in
#: collection order, so these go out first and none is left running alone at the end
#: (longest processing time first); measured on a quiet 2-core machine.
LONGEST_FIRST = (
    "tests/db/test_replica_promotion.py",  # 165 s: a primary and a replica per test
    "tests/project/test_pages.py",  # 60 s: every recipe page in a fresh venv
    "tests/scope/test_scope_trigger.py",
    "tests/scope/test_scope_fallback.py",
    "tests/topologies/test_redis_topologies.py",
    "tests/lease/test_renew.py",
    "tests/integrations/test_alembic.py",
    "tests/integrations/test_side_effects.py",
    "tests/chaos/test_chaos.py",
    "tests/orm/test_inheritance_shapes.py",
    "tests/cli/test_check.py",
    "tests/scope/test_transaction_sql.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in its order; the rest as collected (a stable
    sort, the same on every xdist worker)."""
    rank = {path: n for n, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_unconfigure(config: pytest.Config) -> None:
    """After failures, last: the command that re-runs just those tests (or their files)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or hasattr(config, "workerinput"):  # an xdist worker
        return
    failed = [r.nodeid for kind in ("failed", "error") for r in reporter.stats.get(kind, [])]
    nodeids = list(dict.fromkeys(n for n in failed if n))
    if not nodeids:
        return
    if len(nodeids) > 20:  # a long list would hide the rest: their files instead
        nodeids = list(dict.fromkeys(n.split("::", 1)[0] for n in nodeids))
    python = sys.executable.removeprefix(os.getcwd() + os.sep)  # .venv/bin/python here
    command = " ".join(shlex.quote(a) for a in [python, "-m", "pytest", *nodeids])
    reporter.write_line(f"re-run the failures alone: {command}")
