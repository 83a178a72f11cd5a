"""A streaming replica promoted after the primary dies (docs/reliability.md).

The tests start a primary and a streaming replica of it (``pg_basebackup
-R``) on private clusters; the replica reaches the primary through a TCP
proxy (tests/_tcp_proxy.py) that the test can *hold*: the replica then stops
receiving WAL while the primary goes on committing, which is what
asynchronous replication does under lag.  (Pausing WAL *replay* with
``pg_wal_replay_pause()`` loses nothing: promotion replays all received WAL
first, as the first test shows.)  Then the primary crashes and the replica
is promoted.

With asynchronous replication, grants the replica never received are lost:
the promoted sequence hands their tokens out again, and the register holds
an older token for a name again, so the holder before a lost grant passes
the commit check once more.  ``sa-fence repair-sequence --after-failover``
moves the sequence past every token the lost primary can have handed out
(its own last value plus a margin) and gives every name of the register a
new token, which fences out every lease granted before.  With synchronous
replication no grant is acknowledged before the replica has it, and a
promoted replica needs no repair.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import sa_fence
from sa_fence.cli import check as _check
from sa_fence.cli import main as cli
from sa_fence.db.register import LEASE_STALE_SQLSTATE
from tests._pg_cluster import PgCluster, make_replica, private_cluster
from tests._tcp_proxy import TcpProxy
from tests.models import SEQUENCE, Base, Job

pytestmark = pytest.mark.slow

DB = "fence"
#: Grants on the primary the replica never receives (more than the 32 values
#: the sequence logs ahead, so some of them are past what the replica knows).
LOST_GRANTS = 40
#: More than the tokens the lost primary handed out past the replica's last value
#: (9 here), and small enough that only a target counted from that last value
#: (not from the surviving rows and register, far below it) gets past them.
MARGIN = 20


@contextmanager
def primary_and_replica(*, synchronous: bool) -> Iterator[tuple[PgCluster, PgCluster, TcpProxy]]:
    with private_cluster("primary") as primary:
        primary.create_database(DB)
        engine = sa.create_engine(primary.url(DB), poolclass=sa.pool.NullPool)
        Base.metadata.create_all(engine)
        engine.dispose()
        with TcpProxy(("127.0.0.1", primary.port), name="replication") as proxy:
            replica = make_replica(primary, "replica", via_port=proxy.port)
            try:
                replica.start()
                wait_caught_up(primary, replica)
                if synchronous:  # once the standby streams (or every commit would wait)
                    primary.sql("ALTER SYSTEM SET synchronous_standby_names = 'replica'")
                    primary.sql("SELECT pg_reload_conf()")
                    _wait_sync(primary)
                yield primary, replica, proxy
            finally:
                replica.stop("immediate")


def _wait_sync(primary: PgCluster) -> None:
    deadline = time.monotonic() + 60
    while primary.sql("SELECT sync_state FROM pg_stat_replication") != [("sync",)]:
        if time.monotonic() > deadline:
            raise TimeoutError("the replica never became the synchronous standby")
        time.sleep(0.01)


def wait_caught_up(primary: PgCluster, replica: PgCluster, what: str = "replay") -> None:
    # The insert position, not the write position: a grant that skipped its commit's WAL flush
    # (synchronous_commit off for it, the draw already flushed) leaves its commit record in the
    # WAL buffers until the WAL writer writes it, and under load the write position could be
    # passed before the last grant's commit reached the replica (39 == 40 grants, issue 49).
    lsn = primary.sql("SELECT pg_current_wal_insert_lsn()")[0][0]
    function = "pg_last_wal_replay_lsn()" if what == "replay" else "pg_last_wal_receive_lsn()"
    deadline = time.monotonic() + 60
    while not replica.sql(f"SELECT coalesce({function} >= '{lsn}'::pg_lsn, false)")[0][0]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replica's {what} did not reach {lsn}")
        time.sleep(0.01)


@contextmanager
def fencer_on(
    cluster: PgCluster, client: redis.Redis, key_prefix: str
) -> Iterator[tuple[sa_fence.Fencer, sa.Engine]]:
    engine = sa.create_engine(cluster.url(DB))
    fencer = sa_fence.Fencer(client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    try:
        yield fencer, engine
    finally:
        fencer.close()
        engine.dispose()


def write_job(fencer: sa_fence.Fencer, engine: sa.Engine, job_id: int, result: str) -> int:
    """Take lease job:<id>, write the job under it, commit, release; return the token."""
    make_session = sa_fence.install(sessionmaker(engine))
    with fencer.acquire(f"job:{job_id}", 30) as lease, make_session() as session:
        lease.bind(session)
        session.merge(Job(id=job_id, result=result))
        session.commit()
        return lease.token


def next_token(cluster: PgCluster) -> int:
    last, called = cluster.sql(f"SELECT last_value, is_called FROM {SEQUENCE}", DB)[0]
    return int(last) + 1 if called else int(last)


def register(cluster: PgCluster) -> dict[str, int]:
    return {n: int(t) for n, t in cluster.sql("SELECT name, token FROM sa_fence_leases", DB)}


def commit_check_passes(cluster: PgCluster, name: str, token: int) -> bool:
    """Would a transaction of a session bound to lease (name, token) commit here?"""
    with cluster.connect(DB, autocommit=False) as conn:
        conn.execute("INSERT INTO audit (message) VALUES ('probe')")  # it wrote something
        try:
            conn.execute("SELECT sa_fence_check_lease(%s, %s)", (name, token))
        except psycopg.Error as exc:
            if exc.sqlstate != LEASE_STALE_SQLSTATE:
                raise
            return False
        finally:
            conn.rollback()
    return True


def lose_grants_in_a_failover(
    primary: PgCluster, replica: PgCluster, proxy: TcpProxy, client: redis.Redis, prefix: str
) -> dict[str, Any]:
    """Job 1 written by holder A (replicated); then, unreplicated: holder B takes
    job:1 over and writes it, and LOST_GRANTS other grants; the primary crashes and
    the replica is promoted.  Returns what the old primary handed out."""
    with fencer_on(primary, client, prefix) as (fencer, engine):
        token_a = write_job(fencer, engine, 1, "by A")
        wait_caught_up(primary, replica)
        proxy.hold()  # from here on the replica receives nothing
        token_b = write_job(fencer, engine, 1, "by B")  # acknowledged, never replicated
        others = [fencer.acquire(f"other:{i}", 30).token for i in range(LOST_GRANTS)]
    primary.crash()
    proxy.cut()
    replica.promote()
    return {"a": token_a, "b": token_b, "max": max([token_b, *others])}


# ------------------------------------------------------------------- tests


def test_pausing_replay_loses_nothing_promotion_replays_all_received_wal(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    with primary_and_replica(synchronous=False) as (primary, replica, _):
        replica.sql("SELECT pg_wal_replay_pause()")
        with fencer_on(primary, redis_client, key_prefix) as (fencer, _engine):
            granted = [fencer.acquire(f"job:{i}", 30).token for i in range(LOST_GRANTS)]
        wait_caught_up(primary, replica, "receive")
        primary.crash()
        replica.promote()
        assert next_token(replica) > max(granted)
        assert len(register(replica)) == LOST_GRANTS


def test_an_asynchronous_replica_promoted_after_lost_grants_hands_their_tokens_out_again(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    with primary_and_replica(synchronous=False) as (primary, replica, proxy):
        handed_out = lose_grants_in_a_failover(primary, replica, proxy, redis_client, key_prefix)

        # The sequence: behind tokens the old primary handed out.
        assert next_token(replica) <= handed_out["max"]
        # The rows and the register: B's acknowledged commit and grant are gone,
        # the register holds A's token for job:1 again.
        assert replica.sql("SELECT result, fence FROM jobs", DB) == [("by A", handed_out["a"])]
        assert register(replica) == {"job:1": handed_out["a"]}
        # So A, whose lease B's lost grant had ended, would commit once more...
        assert commit_check_passes(replica, "job:1", handed_out["a"])
        # ...and new grants repeat tokens already handed out.
        with fencer_on(replica, redis_client, key_prefix + "new:") as (fencer, _engine):
            again = [fencer.acquire(f"new:{i}", 30).token for i in range(LOST_GRANTS)]
        assert set(again) & set(range(handed_out["a"] + 1, handed_out["max"] + 1))


def test_repair_sequence_without_after_failover_leaves_the_stale_holder_able_to_commit(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Moving the sequence past the surviving register plus the margin is enough for
    the tokens here; the register still holds A's token for job:1 again."""
    with primary_and_replica(synchronous=False) as (primary, replica, proxy):
        handed_out = lose_grants_in_a_failover(primary, replica, proxy, redis_client, key_prefix)
        assert cli.main(["repair-sequence", "--url", _url(replica), "--yes"]) == 0
        assert next_token(replica) > handed_out["max"]
        assert commit_check_passes(replica, "job:1", handed_out["a"])


def test_repair_sequence_after_failover_moves_past_every_token_and_fences_out_old_leases(
    redis_client: redis.Redis, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with primary_and_replica(synchronous=False) as (primary, replica, proxy):
        handed_out = lose_grants_in_a_failover(primary, replica, proxy, redis_client, key_prefix)
        capsys.readouterr()
        status = cli.main(
            [
                "repair-sequence",
                "--url",
                _url(replica),
                "--after-failover",
                "--margin",
                str(MARGIN),
                "--yes",
            ]
        )
        out = " ".join(capsys.readouterr().out.split())
        assert status == 0, out
        assert "1 lease name(s) in the register to fence out" in out
        assert "every lease name of the register now holds a new token" in out

        first = next_token(replica)
        assert first > handed_out["max"]  # past every token the old primary handed out
        fenced_out = register(replica)["job:1"]
        assert fenced_out > handed_out["max"]
        assert not commit_check_passes(replica, "job:1", handed_out["a"])  # A: refused
        assert not commit_check_passes(replica, "job:1", handed_out["b"])  # B: refused
        with fencer_on(replica, redis_client, key_prefix + "new:") as (fencer, engine):
            token_c = write_job(fencer, engine, 1, "by C")  # a new holder works as usual
        assert token_c > fenced_out
        assert replica.sql("SELECT result, fence FROM jobs", DB) == [("by C", token_c)]
        assert sequence_findings(replica) == []


def test_a_promoted_synchronous_replica_has_every_acknowledged_grant_and_needs_no_repair(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    with primary_and_replica(synchronous=True) as (primary, replica, proxy):
        with fencer_on(primary, redis_client, key_prefix) as (fencer, engine):
            token_a = write_job(fencer, engine, 1, "by A")
            granted = {f"other:{i}": fencer.acquire(f"other:{i}", 30).token for i in range(40)}
            granted["job:1"] = token_a

            # While the replica receives nothing, no grant is acknowledged: the
            # grant waits for the replica, so its token is never handed out.
            proxy.hold()
            outcome: list[Any] = []
            waiting = threading.Thread(
                target=lambda: outcome.append(_acquire_or_error(fencer, "job:2")), daemon=True
            )
            waiting.start()
            waiting.join(timeout=1.0)
            assert waiting.is_alive()
            assert outcome == []
            primary.crash()
            waiting.join(timeout=60)
            assert len(outcome) == 1
            assert isinstance(outcome[0], sa_fence.LeaseBackendError)
        proxy.cut()
        replica.promote()

        assert next_token(replica) > max(granted.values())  # no token handed out again
        assert register(replica) == granted  # every acknowledged grant is there
        assert replica.sql("SELECT result, fence FROM jobs", DB) == [("by A", token_a)]
        assert sequence_findings(replica) == []  # nothing to repair


def test_a_grant_waits_for_the_synchronous_replica_under_synchronous_commit_local(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """synchronous_commit = 'local' (a database's or role's setting) commits without waiting
    for the standbys: a grant returned while the replica had nothing, and promotion handed
    its token out again. The grant raises it to 'on' for itself."""
    with primary_and_replica(synchronous=True) as (primary, _replica, proxy):
        primary.sql(f"ALTER DATABASE {DB} SET synchronous_commit = local")
        with fencer_on(primary, redis_client, key_prefix) as (fencer, _engine):
            fencer.check()
            proxy.hold()
            outcome: list[Any] = []
            waiting = threading.Thread(
                target=lambda: outcome.append(_acquire_or_error(fencer, "job:1")), daemon=True
            )
            waiting.start()
            waiting.join(timeout=1.0)
            assert waiting.is_alive()  # waiting for the standby, not returned
            assert outcome == []
            proxy.heal()
            waiting.join(timeout=60)
            assert len(outcome) == 1
            assert isinstance(outcome[0], sa_fence.Lease)
            outcome[0].release()


def test_a_cancelled_wait_for_the_synchronous_replica_hands_out_a_token_promotion_repeats(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The documented exception (docs/reliability.md): PostgreSQL ends a cancelled
    wait for the synchronous standby with a WARNING and reports the commit as done,
    so the grant returns a token that only the lost primary has."""
    with primary_and_replica(synchronous=True) as (primary, replica, proxy):
        with fencer_on(primary, redis_client, key_prefix) as (fencer, _engine):
            fencer.check()
            proxy.hold()
            canceller = threading.Timer(
                1.0,
                lambda: primary.sql(
                    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
                    "WHERE wait_event = 'SyncRep'"
                ),
            )
            canceller.start()
            try:
                lease = fencer.acquire("job:1", 30)  # returns, after the cancel
            finally:
                canceller.join()
        primary.crash()
        proxy.cut()
        replica.promote()
        assert register(replica) == {}
        assert next_token(replica) <= lease.token  # handed out again


def sequence_findings(cluster: PgCluster) -> list[str]:
    """What ``sa-fence check`` finds about the sequence (the test schema has no guards)."""
    engine = sa.create_engine(cluster.url(DB), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            report = _check.check(conn, sequence=SEQUENCE)
    finally:
        engine.dispose()
    return [f.problem for f in report.findings if f.subject.startswith("sequence")]


def _acquire_or_error(fencer: sa_fence.Fencer, name: str) -> Any:
    try:
        return fencer.acquire(name, 30)
    except Exception as exc:
        return exc


def _url(cluster: PgCluster) -> str:
    return cluster.url(DB).render_as_string(hide_password=False)
