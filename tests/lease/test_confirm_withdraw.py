"""The confirm after a grant, and the withdrawal of an unconfirmed token, in both front ends.

Between ``SET NX`` and the owner-checked CONFIRM the grant draws its token.
If the lease key is gone (the TTL ran out) or taken over by then, the token
was never used: acquire raises LeaseLostError, leaves nothing of its own in
Redis, and puts the register back to the live holder's token
(docs/guarantees.md, "Token order follows grant order").  The seam is
deterministic: the token draw itself first ends the key (and, for "taken
over", lets a second holder B be granted the name).

Each test has its pair: without the confirm (the script's answer forced to
"still held") the lost holder gets a lease whose token is larger than the
live holder's; without the withdrawal the live holder's commits are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.db import register as _register
from tests._fronts import front, io
from tests.models import Job

__all__ = ["front"]  # the fixture, imported for the tests below


def register_token(engine: sa.Engine, name: str) -> int | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT token FROM sa_fence_leases WHERE name = :n"), {"n": name}
        ).scalar()


def commit_a_job(lease: sa_fence.Lease, make_session: sessionmaker[Session]) -> None:
    with make_session() as session:
        lease.bind(session)
        session.add(Job(id=1, result="B"))
        session.commit()


class LostBeforeConfirm:
    """Patches the front end's token draw: before drawing (``after_draw``: after), the
    lease key ends (``taken_over``: and the sync ``other`` fencer is granted the name)."""

    def __init__(
        self,
        front: Any,
        other: sa_fence.Fencer,
        client: redis.Redis,
        *,
        taken_over: bool,
        monkeypatch: pytest.MonkeyPatch,
        after_draw: bool = False,
    ) -> None:
        self.b: sa_fence.Lease | None = None
        self.other = other
        self.client = client
        self.taken_over = taken_over
        if isinstance(front, sa_fence.AsyncFencer):
            original_async = front._next_token

            async def next_token_async(name: str) -> int:
                if not after_draw:
                    self.end(front.key(name), name)
                token: int = await original_async(name)
                if after_draw:
                    self.end(front.key(name), name)
                return token

            monkeypatch.setattr(front, "_next_token", next_token_async)
        else:
            original = front._tokens.next_token

            def next_token(name: str) -> int:
                if not after_draw:
                    self.end(front.key(name), name)
                token = original(name)
                if after_draw:
                    self.end(front.key(name), name)
                return token

            monkeypatch.setattr(front._tokens, "next_token", next_token)

    def end(self, key: str, name: str) -> None:
        if self.b is None:
            assert self.client.delete(key) == 1  # A's TTL ran out
            if self.taken_over:
                self.b = self.other.acquire(name, 5)


@pytest.fixture
def other(
    redis_client: redis.Redis, engine: sa.Engine, key_prefix: str
) -> Callable[[], sa_fence.Fencer]:
    from tests.models import SEQUENCE

    return lambda: sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=key_prefix)


@pytest.mark.parametrize("after_draw", [False, True], ids=["before-its-draw", "after-its-draw"])
async def test_a_lease_taken_over_before_its_confirm_is_lost_and_its_token_withdrawn(
    front: Any,
    other: Callable[[], sa_fence.Fencer],
    redis_client: redis.Redis,
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    after_draw: bool,
) -> None:
    """A's lease ends and B is granted the name before A's confirm.  B drew first: A's
    larger token is withdrawn.  B drew after A (``after-its-draw``): the register holds
    B's larger token, not A's, so A's withdrawal leaves it; it never undoes a newer grant.
    Either way B's key is untouched and B commits."""
    seam = LostBeforeConfirm(
        front,
        other(),
        redis_client,
        taken_over=True,
        monkeypatch=monkeypatch,
        after_draw=after_draw,
    )
    with pytest.raises(sa_fence.LeaseLostError, match="thrown away") as lost:
        await io(front.acquire("job:1", 5))
    b = seam.b
    assert b is not None
    a_token = b.token - 1 if after_draw else b.token + 1  # the draws came one after the other
    assert f"token {a_token} " in str(lost.value)
    assert redis_client.get(b.key) == f"{b.owner}:{b.token}".encode()  # B's, untouched
    assert register_token(engine, "job:1") == b.token  # A's token withdrawn, or never there
    commit_a_job(b, make_session)  # the live holder is not fenced out
    b.release()


async def test_a_lease_gone_before_its_confirm_is_lost_and_leaves_nothing_in_redis(
    front: Any,
    other: Callable[[], sa_fence.Fencer],
    redis_client: redis.Redis,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    LostBeforeConfirm(front, other(), redis_client, taken_over=False, monkeypatch=monkeypatch)
    with pytest.raises(sa_fence.LeaseLostError, match="thrown away"):
        await io(front.acquire("job:1", 5))
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []


async def test_a_first_grant_of_a_name_lost_before_its_confirm_keeps_its_register_row(
    front: Any,
    other: Callable[[], sa_fence.Fencer],
    redis_client: redis.Redis,
    engine: sa.Engine,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A name's first grant has no token before it to go back to: the withdrawal leaves
    the row as it is (no holder's commit can be refused by a token nobody holds), and
    fails at nothing (it would write a NULL token otherwise, and log its failure)."""
    name = f"first:{key_prefix}"  # never granted before in this database
    LostBeforeConfirm(front, other(), redis_client, taken_over=False, monkeypatch=monkeypatch)
    with pytest.raises(sa_fence.LeaseLostError, match="thrown away") as lost:
        await io(front.acquire(name, 5))
    assert register_token(engine, name) is not None
    assert f"token {register_token(engine, name)}" in str(lost.value)
    assert "could not withdraw" not in caplog.text


async def test_without_the_withdrawal_the_live_holder_is_fenced_out_by_the_lost_token(
    front: Any,
    other: Callable[[], sa_fence.Fencer],
    redis_client: redis.Redis,
    engine: sa.Engine,
    make_session: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the first test, withdrawal removed."""
    seam = LostBeforeConfirm(front, other(), redis_client, taken_over=True, monkeypatch=monkeypatch)
    monkeypatch.setattr(front._tokens, "withdraw", lambda name, token: None)
    with pytest.raises(sa_fence.LeaseLostError, match="thrown away"):
        await io(front.acquire("job:1", 5))
    b = seam.b
    assert b is not None
    assert register_token(engine, "job:1") != b.token
    with pytest.raises(sa_fence.StaleTokenError, match="commit refused"):
        commit_a_job(b, make_session)
    b.release()


async def test_without_the_confirm_the_lost_holder_gets_a_larger_token_than_the_live_one(
    front: Any,
    other: Callable[[], sa_fence.Fencer],
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the first test, the confirm's answer forced to "still held"."""
    seam = LostBeforeConfirm(front, other(), redis_client, taken_over=True, monkeypatch=monkeypatch)

    async def held_async(keys: Any, args: Any) -> int:
        return 1000

    def held(keys: Any, args: Any) -> int:
        return 1000

    is_async = isinstance(front, sa_fence.AsyncFencer)
    monkeypatch.setattr(front, "_confirm", held_async if is_async else held)
    a = await io(front.acquire("job:1", 5))
    b = seam.b
    assert b is not None
    assert a.token > b.token  # A would now fence out the real holder B
    b.release()


async def test_a_withdrawal_that_fails_is_logged_and_the_acquire_still_reports_the_loss(
    front: Any,
    other: Callable[[], sa_fence.Fencer],
    redis_client: redis.Redis,
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The withdrawal is the failure path's best effort: its own error never replaces the
    LeaseLostError, and the warning says what it leaves (the live holder fenced out until
    the name is granted again)."""
    seam = LostBeforeConfirm(front, other(), redis_client, taken_over=True, monkeypatch=monkeypatch)
    monkeypatch.setattr(_register.Register, "withdraw_sql", lambda self: sa.text("SELECT 1/0"))
    with (
        caplog.at_level(logging.WARNING, logger="sa_fence"),
        pytest.raises(sa_fence.LeaseLostError, match="thrown away"),
    ):
        await io(front.acquire("job:1", 5))
    assert "could not withdraw the unused token" in caplog.text
    assert "division by zero" in caplog.text  # the cause, in the logged traceback
    b = seam.b
    assert b is not None
    assert register_token(engine, "job:1") != b.token  # as the warning says
    b.release()
