"""Lease names are checked in UTF-8 bytes before anything is written (issue 19, item 7).

The name is the lease register's primary key: a name its btree index cannot
hold, or one with no UTF-8 form, is a bad argument (ValueError naming the
problem), not an outage, and neither Redis nor PostgreSQL sees it.
"""

from __future__ import annotations

import random
import re

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.lease import protocol as proto
from tests.models import Job

#: 1,024 distinct CJK characters: 3,072 bytes of UTF-8 that do not compress (with
#: repeats PostgreSQL may compress the index entry enough to fit).
LONG_CJK = "".join(random.Random(19).sample([chr(c) for c in range(0x4E00, 0xA000)], 1024))
LONE_SURROGATE = "job:\udc80"


def register_names(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT name FROM sa_fence_leases")).scalars())


def redis_keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*"))


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        (LONG_CJK, "lease name must be at most 2048 bytes in UTF-8, got 3072 bytes (1024 ch"),
        (LONE_SURROGATE, "lease name is not encodable as UTF-8: '\\udc80' at position 4 is a lo"),
    ],
    ids=["3072 bytes", "lone surrogate"],
)
def test_a_name_the_register_cannot_hold_is_refused_before_anything_is_written(
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
    name: str,
    problem: str,
) -> None:
    before = register_names(engine)
    with pytest.raises(ValueError, match="^" + re.escape(problem)):
        fencer.acquire(name, 5)
    assert redis_keys(redis_client, key_prefix) == []
    assert register_names(engine) == before


@pytest.mark.parametrize(
    ("name", "error"),
    [(LONG_CJK, sa_fence.LeaseBackendError), (LONE_SURROGATE, UnicodeEncodeError)],
    ids=["3072 bytes", "lone surrogate"],
)
def test_without_the_byte_check_the_name_fails_late_as_the_wrong_error(
    fencer: sa_fence.Fencer,
    monkeypatch: pytest.MonkeyPatch,
    redis_client: redis.Redis,
    key_prefix: str,
    name: str,
    error: type[BaseException],
) -> None:
    """The pair: the old check (characters only) lets both names through to the
    servers: an index error reported as an outage, a raw UnicodeEncodeError."""

    def by_characters_only(value: object) -> str:
        assert isinstance(value, str)
        if not value or len(value) > proto.MAX_NAME_LENGTH or "\x00" in value:
            raise ValueError("refused by the old check")
        return value

    monkeypatch.setattr(proto, "check_name", by_characters_only)
    with pytest.raises(error, match=r"index row size|surrogates not allowed"):
        fencer.acquire(name, 5)
    assert redis_keys(redis_client, key_prefix) == []  # the failed grant cleaned up after itself


@pytest.mark.parametrize(
    "name",
    [
        "ж" * proto.MAX_NAME_LENGTH,  # 2,048 bytes: the limit
        LONG_CJK[: proto.MAX_NAME_BYTES // 3],  # 682 incompressible CJK characters
    ],
    ids=["2048 bytes", "682 CJK"],
)
def test_a_name_at_the_byte_limit_is_granted_and_checked_at_commit(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine, name: str
) -> None:
    with fencer.acquire(name, 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Job(id=1, result="ok"))
        session.commit()
    assert name in register_names(engine)
