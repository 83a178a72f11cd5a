"""Set-up mistakes are refused with an error that says how to fix them, and nothing is written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

import sa_fence
from sa_fence.db.dialect import check_dialect
from tests._fresh_db import fresh_database


def keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*"))


@pytest.fixture
def sequence(engine: sa.Engine) -> Iterator[str]:
    """A scratch sequence name the test may create however it likes."""
    name = "scratch_token_seq"
    yield name
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP SEQUENCE IF EXISTS {name}"))


def make_fencer(
    redis_client: redis.Redis, engine: sa.Engine, sequence: str, key_prefix: str
) -> sa_fence.Fencer:
    return sa_fence.Fencer(redis_client, engine, sequence=sequence, key_prefix=key_prefix)


@pytest.mark.parametrize(
    ("ddl", "match"),
    [
        ("CREATE SEQUENCE {} AS bigint CACHE 20", "CACHE 20"),
        ("CREATE SEQUENCE {} AS bigint CACHE 1 CYCLE", "NO CYCLE"),
        ("CREATE SEQUENCE {} AS integer CACHE 1", "its type is integer"),
        ("CREATE SEQUENCE {} AS bigint INCREMENT BY -1", "INCREMENT -1"),
        (None, "does not exist"),
    ],
    ids=["cache-20", "cycle", "integer", "descending", "missing"],
)
def test_an_unfit_token_sequence_is_refused_before_any_lease_is_written(
    engine: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
    sequence: str,
    ddl: str | None,
    match: str,
) -> None:
    if ddl:
        with engine.begin() as conn:
            conn.execute(sa.text(ddl.format(sequence)))
    fencer = make_fencer(redis_client, engine, sequence, key_prefix)
    with pytest.raises(sa_fence.FencingConfigError, match=match) as refused:
        fencer.acquire("job:1", 5)
    assert "CACHE 1" in str(refused.value)  # says how to fix it
    assert keys(redis_client, key_prefix) == []


def test_the_sequence_helper_declares_a_sequence_and_register_the_fencer_accepts(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    with fresh_database("helper") as engine:
        metadata = sa.MetaData()
        seq = sa_fence.fence_schema(metadata, "scratch_token_seq")
        metadata.create_all(engine)
        assert seq.cache == 1
        assert "sa_fence_leases" in metadata.tables
        fencer = make_fencer(redis_client, engine, "scratch_token_seq", key_prefix)
        with fencer.acquire("job:1", 5) as lease:
            assert lease.token == 1
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT name, token FROM sa_fence_leases")).all() == [
                ("job:1", 1)
            ]
        fencer.close()


def test_the_sequence_helper_refuses_what_it_cannot_declare_and_declares_nothing() -> None:
    """Base for Base.metadata, a name that is no name, and a second token sequence whose
    register would be the first's: each refused naming the fix, the metadata unchanged."""

    class Base(DeclarativeBase):
        pass

    with pytest.raises(TypeError, match=r"did you mean Base\.metadata\?"):
        sa_fence.fence_schema(Base)  # type: ignore[arg-type]
    for bad in (None, 5, "", "tok\nens"):
        with pytest.raises(ValueError, match="sequence"):
            sa_fence.fence_schema(sa.MetaData(), bad)  # type: ignore[arg-type]
    metadata = sa.MetaData()
    sa_fence.fence_schema(metadata, "first_seq")
    sa_fence.fence_schema(metadata, "first_seq")  # the same again: the same register
    declared = (sorted(metadata.tables), sorted(metadata._sequences))
    with pytest.raises(ValueError, match="one register per schema draws from one sequence"):
        sa_fence.fence_schema(metadata, "second_seq")
    assert (sorted(metadata.tables), sorted(metadata._sequences)) == declared
    sa_fence.fence_schema(metadata, "second_seq", schema="other")  # its own register
    assert "other.sa_fence_leases" in metadata.tables


def test_a_fencer_naming_another_sequence_than_its_registers_is_refused(
    engine: sa.Engine, redis_client: redis.Redis, key_prefix: str, sequence: str
) -> None:
    """One register, one sequence: a second sequence's tokens could overtake the first's."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SEQUENCE {sequence} AS bigint CACHE 1 NO CYCLE"))
    fencer = make_fencer(redis_client, engine, sequence, key_prefix)
    with pytest.raises(
        sa_fence.FencingConfigError, match="draws its tokens from sequence"
    ) as refused:
        fencer.acquire("job:1", 5)
    assert "sequence='sa_fence_token_seq'" in str(refused.value)  # says how to fix it
    assert keys(redis_client, key_prefix) == []


def test_synchronous_commit_off_is_refused_before_any_lease_is_written(
    database_url: sa.URL, engine: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """(``engine`` creates the sequence and the register: the refusal is about the setting.)"""
    unsafe = sa.create_engine(database_url, connect_args={"options": "-c synchronous_commit=off"})
    name = f"{key_prefix}job:1"  # the register is shared: a name no other test grants
    registered = sa.text("SELECT count(*) FROM sa_fence_leases WHERE name = :name")
    try:
        fencer = sa_fence.Fencer(redis_client, unsafe, key_prefix=key_prefix)
        with pytest.raises(sa_fence.FencingConfigError, match="synchronous_commit"):
            fencer.acquire(name, 5)
        assert keys(redis_client, key_prefix) == []
        with unsafe.connect() as conn:  # the check refused it before the grant was sent
            assert conn.execute(registered, {"name": name}).scalar_one() == 0
        # Even past the one-time check, every token re-reads the setting and the
        # lease taken for it is given back.
        fencer._tokens.checked = True
        with pytest.raises(sa_fence.FencingConfigError, match="synchronous_commit"):
            fencer.acquire(name, 5)
        assert keys(redis_client, key_prefix) == []
    finally:
        unsafe.dispose()


def test_a_database_that_is_not_postgresql_is_refused(redis_client: redis.Redis) -> None:
    with pytest.raises(sa_fence.FencingConfigError, match="needs PostgreSQL"):
        sa_fence.Fencer(redis_client, sa.create_engine("sqlite://"))


def test_a_driver_without_executemany_rowcounts_is_refused() -> None:
    with pytest.raises(sa_fence.FencingConfigError, match="psycopg"):
        check_dialect(PGDialect_asyncpg())


def test_an_async_redis_client_is_refused(engine: sa.Engine) -> None:
    with pytest.raises(TypeError, match=r"sync redis\.Redis"):
        sa_fence.Fencer(redis.asyncio.Redis(), engine)  # type: ignore[arg-type]


def test_installing_on_the_base_session_class_is_refused() -> None:
    with pytest.raises(TypeError, match="every session in the process"):
        sa_fence.install(Session)


def test_calls_given_the_wrong_kind_of_object_say_what_they_take(engine: sa.Engine) -> None:
    """The commonest slips, a sessionmaker for a Session or None for a lease, are refused
    naming what the call takes, not with an AttributeError from inside."""
    maker = sessionmaker(engine)
    for call in (sa_fence.unbind, lambda s: sa_fence.unfenced(s).__enter__()):
        for wrong in (None, maker):
            with pytest.raises(TypeError, match=r"takes a sqlalchemy Session .*Session\(\)"):
                call(wrong)
    with engine.connect() as conn:
        for lease in (None, "job:1"):
            with (
                pytest.raises(TypeError, match=r"takes a lease \(fencer\.acquire\(\)\)"),
                sa_fence.fence_connection(conn, lease),  # type: ignore[arg-type]
            ):
                pass
    with pytest.raises(TypeError, match="exclude must be a method name or names, got None"):
        sa_fence.fenced_methods("x:{a}", ttl=5, fencer="f", session="s", exclude=None)  # type: ignore[arg-type]
