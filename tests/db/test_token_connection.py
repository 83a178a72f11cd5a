"""The token connection: drawn off the pool's path, yet as robust as a pooled one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
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
    assert any('"public"."sa_fence_grant"(' in stmt for stmt in seen)


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


@contextmanager
def held_fencer(
    engine: sa.Engine, redis_client: Any, key_prefix: str, **engine_options: Any
) -> Iterator[tuple[sa_fence.Fencer, Any]]:
    """A Fencer on an engine of its own after one grant, and its held token connection.
    (An engine some test has listened on keeps the pooled path for good: SQLAlchemy never
    resets ``_has_events``.)  Closed and disposed afterwards."""
    own = sa.create_engine(engine.url, **engine_options)
    fencer = sa_fence.Fencer(redis_client, own, sequence=SEQUENCE, key_prefix=key_prefix)
    try:
        fencer.acquire("job:warm", 30).release()
        held = fencer._tokens._held
        assert held is not None  # the grant took the held connection's path
        yield fencer, held
    finally:
        fencer.close()
        own.dispose()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_draws_on_a_connection_of_its_own_and_leaves_the_parents_alone(
    engine: sa.Engine, redis_client, key_prefix: str
) -> None:
    """The held connection's socket is shared with a forked child: the child must
    neither draw on it (the two processes' messages would interleave) nor close it
    (closing ends the parent's server session); it opens one of its own."""
    with held_fencer(engine, redis_client, key_prefix) as (fencer, held):
        parent_backend = held.info.backend_pid
        pid = os.fork()
        if pid == 0:  # the child: report by exit status, no test machinery
            code = 3
            try:
                fencer.token_source.engine.dispose(close=False)  # as SQLAlchemy asks of a child
                fencer.acquire("job:2", 30).release()
                mine = fencer._tokens._held
                code = 0 if mine is not held and mine.info.backend_pid != parent_backend else 1
                fencer.close()  # drops the inherited connection too, without closing it
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        fencer.acquire("job:1", 30).release()
        assert fencer._tokens._held is held  # still open: the child never closed it
        assert held.info.backend_pid == parent_backend


def test_a_draw_interrupted_on_the_held_connection_drops_it(
    engine: sa.Engine, redis_client, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt (KeyboardInterrupt, a timeout signal's exception) as the grant's
    reply comes in leaves the held connection in an unknown state: it is closed and
    never used again; the next grant opens a new one."""
    with held_fencer(engine, redis_client, key_prefix) as (fencer, held):
        draw = fencer._tokens._draw

        def interrupted(dbapi_conn: object, params: dict[str, object]) -> object:
            draw(dbapi_conn, params)
            raise KeyboardInterrupt

        monkeypatch.setattr(fencer._tokens, "_draw", interrupted)
        with pytest.raises(KeyboardInterrupt):
            fencer.acquire("job:1", 30)
        assert fencer._tokens._held is None
        assert held.closed
        monkeypatch.undo()
        fencer.acquire("job:1", 30).release()
        assert fencer._tokens._held is not None
        assert fencer._tokens._held is not held


def test_the_held_connection_is_replaced_after_the_engines_pool_recycle(
    engine: sa.Engine, redis_client, key_prefix: str
) -> None:
    """``pool_recycle`` (connections older than it are replaced, e.g. before a firewall's
    idle cut) holds for the held token connection too; the clock seam is its birth time."""
    with held_fencer(engine, redis_client, key_prefix, pool_recycle=60) as (fencer, held):
        fencer.acquire("job:1", 30).release()
        assert fencer._tokens._held is held  # younger than pool_recycle: kept
        fencer._tokens._held_since -= 61  # opened 61 s earlier
        fencer.acquire("job:1", 30).release()
        assert fencer._tokens._held is not held
        assert held.closed
