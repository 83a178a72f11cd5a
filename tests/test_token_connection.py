"""The token connection: drawn off the pool's path, yet as robust as a pooled one."""

from __future__ import annotations

import sqlalchemy as sa

import sa_fence
from tests._tools import wait_for
from tests.models import SEQUENCE


def test_a_killed_token_connection_costs_no_acquire_and_tokens_keep_growing(
    engine: sa.Engine, redis_client, key_prefix: str
) -> None:
    own = sa.create_engine(engine.url)
    try:
        fencer = sa_fence.Fencer(redis_client, own, sequence=SEQUENCE, key_prefix=key_prefix)
        first = fencer.acquire("job:1", 30)
        first.release()
        held = fencer._tokens._held
        assert held is not None  # the fast path is in use
        with engine.connect() as conn:
            conn.execute(
                sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": held.info.backend_pid}
            )
        second = fencer.acquire("job:1", 30)  # the dead connection is replaced, no error
        second.release()
        assert second.token > first.token
        assert fencer._tokens._held is not held
    finally:
        own.dispose()


def test_the_token_connection_takes_no_slot_of_the_engines_pool(
    engine: sa.Engine, redis_client, key_prefix: str
) -> None:
    small = sa.create_engine(engine.url, pool_size=1, max_overflow=0, pool_timeout=2)
    try:
        fencer = sa_fence.Fencer(redis_client, small, sequence=SEQUENCE, key_prefix=key_prefix)
        fencer.acquire("job:1", 30).release()
        with small.connect() as conn:  # the single pooled connection is free
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            fencer.acquire("job:2", 30).release()  # and tokens still come while it is used
    finally:
        fencer.close()
        small.dispose()


def test_engines_with_statement_listeners_see_the_token_statement(
    engine: sa.Engine, redis_client, key_prefix: str
) -> None:
    own = sa.create_engine(engine.url)
    seen: list[str] = []
    sa.event.listen(own, "before_cursor_execute", lambda c, cur, stmt, *a: seen.append(stmt))
    try:
        fencer = sa_fence.Fencer(redis_client, own, sequence=SEQUENCE, key_prefix=key_prefix)
        fencer.acquire("job:1", 30).release()
    finally:
        own.dispose()
    assert any('INSERT INTO "public"."sa_fence_leases"' in stmt for stmt in seen)


def test_a_closed_token_connection_is_replaced_before_use(
    engine: sa.Engine, redis_client, key_prefix: str
) -> None:
    own = sa.create_engine(engine.url)
    try:
        fencer = sa_fence.Fencer(redis_client, own, sequence=SEQUENCE, key_prefix=key_prefix)
        fencer.acquire("job:1", 30).release()
        old = fencer._tokens._held
        old.close()
        fencer.acquire("job:1", 30).release()
        assert fencer._tokens._held is not None
        assert fencer._tokens._held is not old
        assert not fencer._tokens._held.closed
    finally:
        fencer.close()
        own.dispose()


def test_fencer_close_ends_the_held_server_connection_and_the_fencer_stays_usable(
    engine: sa.Engine, redis_client, key_prefix: str
) -> None:
    own = sa.create_engine(engine.url)
    try:
        fencer = sa_fence.Fencer(redis_client, own, sequence=SEQUENCE, key_prefix=key_prefix)
        fencer.acquire("job:1", 30).release()
        pid = fencer._tokens._held.info.backend_pid
        fencer.close()

        def backend_gone() -> bool:  # the server ends it once it reads the client's close
            with engine.connect() as conn:
                alive = conn.execute(
                    sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"),
                    {"pid": pid},
                ).scalar_one()
            return alive == 0

        wait_for(backend_gone, 10, "the held connection's server backend to exit after close()")
        fencer.acquire("job:1", 30).release()  # a new connection is opened on demand
    finally:
        fencer.close()
        own.dispose()
