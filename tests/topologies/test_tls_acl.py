"""TLS, the minimal Redis ACL and the minimal PostgreSQL role, on private servers.

Each configuration is the one docs/topologies.md shows (a test checks the
docs carry the same ACL and grants), and each has its pair: one right or one
side of TLS missing, and sa-fence says so as a set-up mistake with the fix.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis
import sqlalchemy as sa
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
import sa_fence.testing
from tests._fresh_db import fresh_database
from tests.conftest import _admin_dsn
from tests.models import SEQUENCE, Base, Job
from tests.topologies._servers import (
    HOST,
    MINIMAL_ACL,
    TlsRedis,
    free_port,
    servers,
    tls_redis,
    wait_until,
)

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "topologies.md"

CLIENT: dict[str, Any] = {
    "socket_timeout": 0.5,
    "socket_connect_timeout": 0.5,
    "retry": Retry(NoBackoff(), 0),
}
BUDGET = 2.0


class Clock:
    def __enter__(self) -> Clock:
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.monotonic() - self.started


def lease_operations(fencer: sa_fence.Fencer, make_session: sessionmaker[Session]) -> None:
    """acquire, contention, extend, a fenced write, release."""
    with fencer.acquire("seed", 30) as seed, make_session() as session:
        seed.bind(session)
        session.add(Job(id=1, result="initial"))
        session.commit()
    lease = fencer.acquire("job:1", 5)
    with pytest.raises(sa_fence.LeaseNotAcquiredError):
        fencer.acquire("job:1", 5)
    lease.extend(10)
    with make_session() as session:
        lease.bind(session)
        session.get(Job, 1).result = "done"
        session.commit()
    assert lease.release() is True


# ---------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls() -> Iterator[TlsRedis]:
    with tls_redis() as server:
        yield server


def test_leases_work_over_tls_with_a_rediss_url(
    tls: TlsRedis, engine: sa.Engine, make_session: sessionmaker[Session], key_prefix: str
) -> None:
    client = redis.Redis.from_url(tls.url(), **CLIENT)
    fencer = sa_fence.Fencer(
        client, engine, sequence=SEQUENCE, key_prefix=key_prefix, timeout=BUDGET
    )
    lease_operations(fencer, make_session)
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    client.close()


@pytest_asyncio.fixture
async def async_tls_client(tls: TlsRedis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(
        tls.url(), socket_timeout=0.5, socket_connect_timeout=0.5, retry=None
    )
    try:
        yield client
    finally:
        await client.aclose()


async def test_async_leases_work_over_tls(
    async_tls_client: aioredis.Redis, async_engine: Any, key_prefix: str
) -> None:
    fencer = sa_fence.AsyncFencer(
        async_tls_client, async_engine, sequence=SEQUENCE, key_prefix=key_prefix
    )
    lease = await fencer.acquire("job:1", 5)
    await lease.extend(10)
    assert await lease.release() is True
    await fencer.close()


def test_a_plain_client_against_the_tls_port_is_a_set_up_mistake_named_as_such(
    tls: TlsRedis, engine: sa.Engine, key_prefix: str
) -> None:
    client = redis.Redis(host=HOST, port=tls.port, **CLIENT)
    fencer = sa_fence.Fencer(
        client, engine, sequence=SEQUENCE, key_prefix=key_prefix, timeout=BUDGET
    )
    with Clock() as clock, pytest.raises(sa_fence.FencingConfigError) as refused:
        fencer.acquire("job:1", 5)
    assert clock.elapsed < BUDGET * 1.5
    assert "expects TLS" in str(refused.value)
    assert "rediss://" in str(refused.value)


def test_a_tls_client_against_a_plain_port_is_a_set_up_mistake_named_as_such(
    tls: TlsRedis, engine: sa.Engine, key_prefix: str
) -> None:
    """Issue 10 measured 20.1 s for this; ~1.5 s now (three 0.5 s handshakes)."""
    with servers("plain") as group:
        port = free_port()
        group.redis("plain", port)
        wait_until(lambda: redis.Redis(port=port).ping(), 10, "redis")
        url = f"rediss://{HOST}:{port}/0?ssl_ca_certs={tls.files.ca}"
        client = redis.Redis.from_url(url, **CLIENT)
        fencer = sa_fence.Fencer(
            client, engine, sequence=SEQUENCE, key_prefix=key_prefix, timeout=BUDGET
        )
        with Clock() as clock, pytest.raises(sa_fence.FencingConfigError) as refused:
            fencer.acquire("job:1", 5)
        assert clock.elapsed < BUDGET * 1.5
        assert "answers in plain Redis" in str(refused.value)
        client.close()


def test_a_server_certificate_the_client_does_not_trust_is_a_set_up_mistake(
    tls: TlsRedis, engine: sa.Engine, key_prefix: str
) -> None:
    client = redis.Redis.from_url(f"rediss://{HOST}:{tls.port}/0", **CLIENT)  # system CAs only
    fencer = sa_fence.Fencer(
        client, engine, sequence=SEQUENCE, key_prefix=key_prefix, timeout=BUDGET
    )
    with Clock() as clock, pytest.raises(sa_fence.FencingConfigError) as refused:
        fencer.acquire("job:1", 5)
    assert clock.elapsed < BUDGET * 1.5
    assert "ssl_ca_certs" in str(refused.value)


# ---------------------------------------------------------------- Redis ACL


@pytest.fixture
def acl_redis() -> Iterator[tuple[redis.Redis, int]]:
    with servers("acl") as group:
        port = free_port()
        group.redis("acl", port)
        admin = redis.Redis(host=HOST, port=port, socket_timeout=1)
        wait_until(admin.ping, 10, "redis")
        yield admin, port
        admin.close()


def set_user(admin: redis.Redis, key_prefix: str, rule: str = MINIMAL_ACL) -> None:
    rules = rule.replace("~sa_fence:*", f"~{key_prefix}*").split()
    admin.execute_command("ACL", "SETUSER", "fencer", "reset", "on", ">secret", *rules)


def acl_fencer(port: int, engine: sa.Engine, key_prefix: str) -> sa_fence.Fencer:
    client = redis.Redis.from_url(f"redis://fencer:secret@{HOST}:{port}/0", **CLIENT)
    return sa_fence.Fencer(client, engine, sequence=SEQUENCE, key_prefix=key_prefix, timeout=BUDGET)


def test_the_minimal_acl_is_enough_for_every_lease_operation(
    acl_redis: tuple[redis.Redis, int],
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    key_prefix: str,
) -> None:
    admin, port = acl_redis
    set_user(admin, key_prefix)
    fencer = acl_fencer(port, engine, key_prefix)
    lease_operations(fencer, make_session)
    renewed = fencer.acquire("job:2", 0.6, renew=True)
    time.sleep(1.5)  # past two TTLs: only renewal keeps it
    assert not renewed.lost
    assert renewed.release() is True
    assert admin.execute_command("ACL", "LOG") == []  # nothing was denied


@pytest.mark.parametrize(
    ("missing", "operation"),
    [("+pexpire", "extend"), ("+pttl", "confirm"), ("+script|load", "acquire")],
)
def test_without_one_acl_right_the_operation_needing_it_is_a_set_up_mistake(
    acl_redis: tuple[redis.Redis, int],
    engine: sa.Engine,
    key_prefix: str,
    missing: str,
    operation: str,
) -> None:
    admin, port = acl_redis
    set_user(admin, key_prefix, MINIMAL_ACL.replace(f" {missing}", ""))
    fencer = acl_fencer(port, engine, key_prefix)
    if operation == "extend":
        call: Any = fencer.acquire("job:1", 5).extend  # acquiring needs no PEXPIRE
    else:
        call = lambda: fencer.acquire("job:1", 5)  # noqa: E731
    with Clock() as clock, pytest.raises(sa_fence.FencingConfigError) as refused:
        call()
    assert clock.elapsed < 1  # never resent
    assert str(refused.value).startswith(f"{operation} of lease 'job:1' failed")
    assert MINIMAL_ACL.replace("sa_fence:", "<key_prefix>") in str(refused.value)


def test_a_key_prefix_outside_the_acl_key_pattern_is_a_set_up_mistake(
    acl_redis: tuple[redis.Redis, int], engine: sa.Engine, key_prefix: str
) -> None:
    admin, port = acl_redis
    set_user(admin, "someone_else:")
    fencer = acl_fencer(port, engine, key_prefix)
    with pytest.raises(sa_fence.FencingConfigError, match="~<key_prefix>"):
        fencer.acquire("job:1", 5)


def test_the_docs_give_the_acl_the_tests_use() -> None:
    text = DOCS.read_text()
    assert MINIMAL_ACL in text
    for statement in ROLE_SQL:
        assert statement.format(role="app_worker", db="app") in text


# ------------------------------------------------------- PostgreSQL role

#: The grants of docs/topologies.md ("PostgreSQL role"), for the test models.
ROLE_SQL = [
    "GRANT CONNECT ON DATABASE {db} TO {role};",
    "GRANT USAGE ON SCHEMA public TO {role};",
    "GRANT EXECUTE ON FUNCTION sa_fence_grant(text, regclass, text, boolean), "
    "sa_fence_withdraw(text, bigint) TO {role};",
    "GRANT SELECT ON sa_fence_leases TO {role};",
    "GRANT SELECT ON SEQUENCE sa_fence_token_seq TO {role};",
    "GRANT INSERT ON sa_fence_scope TO {role};",
    "REVOKE EXECUTE ON FUNCTION sa_fence_check_lease(text, bigint) FROM PUBLIC;",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON jobs, audit TO {role};",
]


@pytest.fixture
def role_database() -> Iterator[tuple[sa.Engine, str]]:
    """A fresh database with the models, and a login role with only the grants above."""
    role = f"sa_fence_role_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        with fresh_database("role") as owner:
            Base.metadata.create_all(owner)
            with owner.begin() as conn:
                for statement in ROLE_SQL:
                    conn.exec_driver_sql(
                        statement.format(role=f'"{role}"', db=f'"{owner.url.database}"')
                    )
            yield owner, role
    finally:
        with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def role_engine(owner: sa.Engine, role: str) -> sa.Engine:
    return sa.create_engine(owner.url.set(username=role), poolclass=sa.pool.NullPool)


def test_a_role_with_only_the_documented_rights_runs_everything_and_is_still_fenced(
    role_database: tuple[sa.Engine, str], redis_client: redis.Redis, key_prefix: str
) -> None:
    owner, role = role_database
    engine = role_engine(owner, role)
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    make_session = sa_fence.install(sessionmaker(engine))
    lease_operations(fencer, make_session)
    stale = fencer.acquire("job:1", 5)
    session = stale.bind(make_session())
    session.get(Job, 1).result = "stale"
    sa_fence.testing.expire(stale)
    with fencer.acquire("job:1", 5) as newer, make_session() as other:
        newer.bind(other)
        other.get(Job, 1).result = "newer"
        other.commit()
    with pytest.raises(sa_fence.StaleTokenError):
        session.commit()  # the scope trigger checks it: no EXECUTE right needed
    session.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT result FROM jobs")).scalar_one() == "newer"
    fencer.close()
    engine.dispose()


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE sa_fence_leases SET token = :mine WHERE name = 'job:1'",
        "DELETE FROM sa_fence_leases WHERE name = 'job:1'",
        "INSERT INTO sa_fence_leases (name, token) VALUES ('job:1', :mine) "
        "ON CONFLICT (name) DO UPDATE SET token = EXCLUDED.token",
        "DELETE FROM sa_fence_scope",
    ],
)
def test_a_stale_holder_cannot_move_the_register_by_hand(
    role_database: tuple[sa.Engine, str],
    redis_client: redis.Redis,
    key_prefix: str,
    statement: str,
) -> None:
    """issue 46: only sa-fence's SECURITY DEFINER functions move the register.  A stale
    holder, running as the documented workers' role, that writes its own token back into
    the register (or deletes its arm) is refused: permission denied, nothing committed, and
    the current holder is not shut out."""
    owner, role = role_database
    engine = role_engine(owner, role)
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    make_session = sa_fence.install(sessionmaker(engine))
    stale = fencer.acquire("job:1", 5)
    session = stale.bind(make_session())
    sa_fence.testing.expire(stale)
    current = fencer.acquire("job:1", 5)
    # (the arm's own table: reported as the set-up mistake of a missing right, which it is)
    with pytest.raises((sa.exc.ProgrammingError, sa_fence.FencingConfigError)) as refused:
        session.execute(sa.text(statement), {"mine": stale.token})
    assert "permission denied" in str(refused.value)
    session.rollback()
    session.close()
    with owner.connect() as conn:
        held = conn.execute(sa.text("SELECT token FROM sa_fence_leases WHERE name = 'job:1'"))
        assert held.scalar_one() == current.token
    with make_session() as other:  # the current holder still commits
        current.bind(other)
        other.execute(sa.text("UPDATE jobs SET result = 'current' WHERE id = 1"))
        other.commit()
    current.release()
    fencer.close()
    engine.dispose()


def test_with_the_write_rights_of_before_a_stale_holder_moves_the_register(
    role_database: tuple[sa.Engine, str], redis_client: redis.Redis, key_prefix: str
) -> None:
    """The pair: given UPDATE on the register (what the grant needed before it became a
    function), the stale holder writes its token back, commits, and the current holder is
    refused."""
    owner, role = role_database
    with owner.begin() as conn:
        conn.exec_driver_sql(f'GRANT UPDATE ON sa_fence_leases TO "{role}"')
    engine = role_engine(owner, role)
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    make_session = sa_fence.install(sessionmaker(engine))
    stale = fencer.acquire("job:1", 5)
    sa_fence.testing.expire(stale)
    current = fencer.acquire("job:1", 5)
    with make_session() as session:
        stale.bind(session)
        session.execute(
            sa.text("UPDATE sa_fence_leases SET token = :mine WHERE name = 'job:1'"),
            {"mine": stale.token},
        )
        session.commit()  # the register holds the stale token again: the check passes
    with make_session() as other:
        current.bind(other)
        other.execute(sa.text("UPDATE jobs SET result = 'current' WHERE id = 1"))
        with pytest.raises(sa_fence.StaleTokenError):
            other.commit()
    current.release()
    fencer.close()
    engine.dispose()


def test_without_the_scope_table_rights_a_bound_session_is_a_set_up_mistake_naming_the_grant(
    role_database: tuple[sa.Engine, str], redis_client: redis.Redis, key_prefix: str
) -> None:
    owner, role = role_database
    with owner.begin() as conn:
        conn.exec_driver_sql(f'REVOKE INSERT ON sa_fence_scope FROM "{role}"')
    engine = role_engine(owner, role)
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    make_session = sa_fence.install(sessionmaker(engine))
    with fencer.acquire("job:9", 5) as lease:
        for _ in range(2):  # an arm of its own, then (schema known) the one in BEGIN
            with make_session() as session:
                lease.bind(session)
                with pytest.raises(sa_fence.FencingConfigError, match="GRANT INSERT ON"):
                    session.execute(sa.text("SELECT 1"))
    fencer.close()
    engine.dispose()


@pytest.mark.parametrize(
    "revoke",
    [
        "REVOKE EXECUTE ON FUNCTION sa_fence_grant(text, regclass, text, boolean) FROM {role}",
    ],
)
def test_without_one_documented_right_the_grant_is_a_set_up_mistake_naming_the_grants(
    role_database: tuple[sa.Engine, str], redis_client: redis.Redis, key_prefix: str, revoke: str
) -> None:
    owner, role = role_database
    with owner.begin() as conn:
        conn.exec_driver_sql(revoke.format(role=f'"{role}"'))
    engine = role_engine(owner, role)
    fencer = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    with pytest.raises(sa_fence.FencingConfigError) as refused:
        fencer.acquire("job:1", 5)
    assert "lacks a right" in str(refused.value)
    assert "GRANT EXECUTE ON FUNCTION" in str(refused.value)
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []  # given back
    fencer.close()
    engine.dispose()
