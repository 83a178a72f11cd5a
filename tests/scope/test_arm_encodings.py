"""The arm carries the lease's token alone: no text of the user's, whatever the client encoding.

Before, the arm wrote the lease name as an SQL literal, always as UTF-8 bytes: under
``client_encoding = LATIN1`` the current holder of ``job:é`` was refused (the arm read
``job:Ã©``), and under SJIS with ``backslash_quote = on`` a name could close the literal and
write no arm at all.  Here each multi-byte and single-byte client encoding PostgreSQL offers a
client runs a current holder (commits) and a stale one (refused), with names that hold a
backslash, a quote and the encoding's own characters.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.db import guard
from sa_fence.db import register as _register
from sa_fence.testing import expire
from tests._scope_fixtures import empty_tables, fencer, scope_engine  # noqa: F401
from tests.models_scope import Outbox

#: (client encoding, a character it encodes that UTF-8 writes otherwise)
ENCODINGS = [
    ("UTF8", "é"),
    ("LATIN1", "é"),
    ("SJIS", "ソ"),  # 0x83 0x5C: its second byte is a backslash
    ("BIG5", "許"),  # 0xB3 0x5C
    ("GBK", "乗"),  # 0x81 0x5C
    ("EUC_JP", "ぁ"),
]
#: What closes a literal and comments the rest out, written after the character.
INJECTION = "\\', 0) LIMIT 0; --"


@pytest.fixture(params=ENCODINGS, ids=[encoding for encoding, _ in ENCODINGS])
def encoded(
    request: pytest.FixtureRequest,
    scope_engine: sa.Engine,  # noqa: F811
) -> Iterator[tuple[sa.Engine, str]]:
    """An engine whose connections use the encoding with backslash_quote on, and a name."""
    encoding, character = request.param
    engine = sa.create_engine(
        scope_engine.url,
        connect_args={
            "client_encoding": encoding,
            "options": "-c backslash_quote=on -c standard_conforming_strings=on",
        },
    )
    yield engine, f"job:{character}{INJECTION}"
    engine.dispose()


def test_the_current_holder_commits_and_a_stale_one_is_refused_in_every_client_encoding(
    fencer: sa_fence.Fencer,  # noqa: F811
    scope_engine: sa.Engine,  # noqa: F811
    encoded: tuple[sa.Engine, str],
) -> None:
    engine, name = encoded
    make_session = sa_fence.install(sessionmaker(engine))
    a = fencer.acquire(name, 5)
    with make_session() as session:
        a.bind(session)
        session.add(Outbox(id=1, message="A, current"))
        session.commit()  # the current holder is never refused
    stale: Session = a.bind(make_session())
    stale.add(Outbox(id=2, message="A, stale"))
    stale.flush()
    assert expire(a)
    b = fencer.acquire(name, 5)
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        stale.commit()
    stale.close()
    assert refused.value.lease_name == name
    assert refused.value.newest_token == b.token
    with make_session() as session:
        b.bind(session)
        session.add(Outbox(id=3, message="B, current"))
        session.commit()
    with scope_engine.connect() as conn:
        messages = conn.execute(sa.text("SELECT message FROM outbox ORDER BY id")).scalars()
        assert list(messages) == ["A, current", "B, current"]
    b.release()


def test_a_name_written_as_a_literal_is_read_otherwise_under_latin1(
    scope_engine: sa.Engine,  # noqa: F811
) -> None:
    """Why the arm may hold no text: the name as UTF-8 bytes in a LATIN1 session is another
    name (the earlier arm's failure, shown on the server)."""
    dsn = scope_engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, client_encoding="LATIN1") as conn:
        literal = guard.quote_literal("job:é").encode()  # as the earlier arm sent it
        conn.pgconn.send_query(b"SELECT " + literal)
        read = conn.pgconn.get_result()
        assert read is not None
        assert read.get_value(0, 0) is not None
        assert read.get_value(0, 0).decode("latin-1") != "job:é"
        while conn.pgconn.get_result() is not None:
            pass


def test_a_lease_of_any_name_arms_with_its_token_only(
    fencer: sa_fence.Fencer,  # noqa: F811
    redis_client: redis.Redis,
    encoded: tuple[sa.Engine, str],
) -> None:
    engine, name = encoded
    make_session = sa_fence.install(sessionmaker(engine))
    with fencer.acquire(name, 5) as lease, make_session() as session:
        lease.bind(session)
        armed = session.execute(
            sa.text(
                "SELECT token, name_key FROM sa_fence_scope "
                "WHERE xmin::text::bigint = pg_current_xact_id()::text::bigint % 4294967296"
            )
        ).all()
        assert [tuple(row) for row in armed] == [(lease.token, _register.name_key(name))]
        session.rollback()


def _reissue_to_another_name(
    fencer: sa_fence.Fencer,  # noqa: F811
    scope_engine: sa.Engine,  # noqa: F811
    lost: sa_fence.Lease,
) -> sa_fence.Lease:
    """What a promoted asynchronous standby does: the grant of ``lost`` is gone from the
    register and the sequence is behind it, so another name is granted ``lost``'s token."""
    with scope_engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM sa_fence_leases WHERE name = :n"), {"n": lost.name})
        conn.execute(sa.text("SELECT setval('sa_fence_token_seq', :t - 1)"), {"t": lost.token})
    other = fencer.acquire(f"{lost.name}:other", 5)
    assert other.token == lost.token
    return other


def _lost_grant_with_a_write(
    fencer: sa_fence.Fencer,  # noqa: F811
    scope_engine: sa.Engine,  # noqa: F811
) -> tuple[Session, sa_fence.Lease]:
    """A holder's session with a write flushed, whose grant a failover then lost and whose
    token went to another name (that name's lease returned)."""
    make_session = sa_fence.install(sessionmaker(scope_engine))
    lost = fencer.acquire("job:lost", 5)
    session: Session = lost.bind(make_session())
    session.add(Outbox(id=1, message="lost grant"))
    session.flush()
    return session, _reissue_to_another_name(fencer, scope_engine, lost)


def test_a_token_handed_out_again_to_another_name_does_not_pass_for_the_lease(
    fencer: sa_fence.Fencer,  # noqa: F811
    scope_engine: sa.Engine,  # noqa: F811
) -> None:
    """The arm holds the lease to its name's key as well as its token: after a failover hands
    the token out again to another name (docs/reliability.md), the lost grant's holder is
    refused, as the register by name refused it before the arm carried no text."""
    session, other = _lost_grant_with_a_write(fencer, scope_engine)
    with pytest.raises(sa_fence.StaleTokenError):
        session.commit()
    session.close()
    with scope_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 0
    other.release()


def test_without_the_name_key_the_other_names_token_passes_for_the_lease(
    fencer: sa_fence.Fencer,  # noqa: F811
    scope_engine: sa.Engine,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair: the check by token alone lets the lost grant's holder commit."""
    key_check = "\n       AND r.name_key OPERATOR(pg_catalog.=) lease_key FOR SHARE"
    assert key_check in _register._CHECK_BODY
    register = _register.Register("sa_fence_token_seq")
    monkeypatch.setattr(
        _register, "_CHECK_BODY", _register._CHECK_BODY.replace(key_check, " FOR SHARE")
    )
    with scope_engine.begin() as conn:
        conn.execute(sa.text(_register.check_function_sql(register)))
    monkeypatch.undo()
    try:
        session, other = _lost_grant_with_a_write(fencer, scope_engine)
        session.commit()  # the outcome the key prevents
        session.close()
        with scope_engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 1
        other.release()
    finally:
        with scope_engine.begin() as conn:
            conn.execute(sa.text(_register.check_function_sql(register)))
