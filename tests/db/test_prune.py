"""Retention of the lease register: ``Fencer.prune()`` and ``sa-fence prune``.

Each test runs in a database of its own (pruning would otherwise delete other
tests' register rows).  A row's age is set by moving its ``granted_at`` back,
not by waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import timedelta
from typing import Any
from unittest import mock

import psycopg
import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from sa_fence.cli import main as cli
from sa_fence.cli import prune as _cli_prune
from sa_fence.db import prune as _prune
from sa_fence.db import register as _register
from sa_fence.testing import expire
from tests._fresh_db import fresh_database, url_of
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE, Base, Job

DAY = 86400


@pytest.fixture
def db() -> Iterator[sa.Engine]:
    with fresh_database("prune") as engine:
        Base.metadata.create_all(engine)
        yield engine


@pytest.fixture
def fencer(db: sa.Engine, redis_client: redis.Redis, key_prefix: str) -> Iterator[sa_fence.Fencer]:
    fencer = sa_fence.Fencer(redis_client, db, sequence=SEQUENCE, key_prefix=key_prefix)
    yield fencer
    fencer.close()


def names(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(sa.text("SELECT name FROM public.sa_fence_leases ORDER BY name")).scalars()
        )


def age(engine: sa.Engine, name: str, days: float) -> None:
    """Make ``name``'s last grant ``days`` days old."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE sa_fence_leases SET granted_at = clock_timestamp() - "
                "make_interval(secs => :s) WHERE name = :n"
            ),
            {"s": days * DAY, "n": name},
        )


def execute(engine: sa.Engine, statement: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(statement))


def grant_and_release(fencer: sa_fence.Fencer, name: str, days_old: float = 0) -> int:
    lease = fencer.acquire(name, 5)
    lease.release()
    if days_old:
        age(fencer.engine, name, days_old)
    return lease.token


@pytest.fixture
def three_names(fencer: sa_fence.Fencer, db: sa.Engine) -> Iterator[sa_fence.Lease]:
    """old:free (40 days, not held), old:held (40 days, held now), new:free (1 day)."""
    grant_and_release(fencer, "old:free", 40)
    held = fencer.acquire("old:held", 30)
    age(db, "old:held", 40)
    grant_and_release(fencer, "new:free", 1)
    yield held
    held.release()


@pytest_asyncio.fixture(params=["sync", "async"])
async def front(
    request: pytest.FixtureRequest, fencer: sa_fence.Fencer, db: sa.Engine, key_prefix: str
) -> AsyncIterator[Any]:
    """Fencer.prune or AsyncFencer.prune, on the test's database and Redis prefix."""
    if request.param == "sync":
        yield fencer
        return
    engine = create_async_engine(db.url.set(drivername="postgresql+psycopg_async"))
    client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        yield sa_fence.AsyncFencer(client, engine, sequence=SEQUENCE, key_prefix=key_prefix)
    finally:
        await client.aclose()
        await engine.dispose()


async def prune_with(front: Any, **kwargs: Any) -> _prune.PruneResult:
    if isinstance(front, sa_fence.AsyncFencer):
        result: _prune.PruneResult = await front.prune(**kwargs)
        return result
    done: _prune.PruneResult = front.prune(**kwargs)
    return done


async def test_prune_deletes_old_rows_of_names_no_one_holds_and_keeps_the_rest(
    front: Any, db: sa.Engine, three_names: sa_fence.Lease
) -> None:
    result = await prune_with(front, older_than=timedelta(days=30), longest_lease=timedelta(days=7))
    assert (result.rows, result.held, result.regranted, result.dry_run) == (1, 1, 0, False)
    assert result.names == ()  # listed by a dry run only
    assert 40 < result.bytes < 200  # one short row
    assert names(db) == ["new:free", "old:held"]


async def test_a_dry_run_reports_the_same_and_deletes_nothing(
    front: Any, db: sa.Engine, three_names: sa_fence.Lease
) -> None:
    result = await prune_with(front, older_than=30 * DAY, longest_lease=7 * DAY, dry_run=True)
    assert (result.rows, result.held, result.dry_run) == (1, 1, True)
    assert result.bytes > 0
    assert result.names == ("old:free",)  # what would go, by name
    assert names(db) == ["new:free", "old:free", "old:held"]


@pytest.mark.parametrize(
    ("older_than", "longest_lease", "error", "problem"),
    [
        (DAY, 2 * DAY, ValueError, r"older_than \(1d\) is shorter than longest_lease \(2d\)"),
        (0, 1, ValueError, "older_than must be a duration > 0 and at most 100 years, got 0"),
        (DAY, float("inf"), ValueError, "longest_lease must be a duration > 0 and at most"),
        ("30d", DAY, TypeError, "older_than must be a number of seconds or a datetime.timedelta"),
        # past PostgreSQL's timestamps (it raised DatetimeFieldOverflow from the server)
        (1e12, DAY, ValueError, "older_than must be a duration > 0 and at most 100 years"),
        (timedelta.max, DAY, ValueError, "at most 100 years"),
    ],
)
def test_an_age_shorter_than_the_longest_lease_or_no_age_is_refused_and_nothing_deleted(
    fencer: sa_fence.Fencer,
    db: sa.Engine,
    three_names: sa_fence.Lease,
    older_than: Any,
    longest_lease: Any,
    error: type[Exception],
    problem: str,
) -> None:
    with pytest.raises(error, match=problem):
        fencer.prune(older_than=older_than, longest_lease=longest_lease)
    assert names(db) == ["new:free", "old:free", "old:held"]


@pytest.mark.parametrize("dry_run", ["false", None, 1])
def test_dry_run_must_be_a_bool_and_nothing_is_deleted(
    fencer: sa_fence.Fencer, db: sa.Engine, three_names: sa_fence.Lease, dry_run: Any
) -> None:
    """``dry_run=None`` deleted (falsy), ``"false"`` only looked (truthy): both refused."""
    with pytest.raises(TypeError, match="dry_run must be True or False"):
        fencer.prune(older_than=30 * DAY, longest_lease=7 * DAY, dry_run=dry_run)
    assert names(db) == ["new:free", "old:free", "old:held"]


def grant_between_scan_and_delete(
    fencer: sa_fence.Fencer, name: str
) -> tuple[Any, dict[str, sa_fence.Lease]]:
    """A ``held(names)`` that asks Redis, and then, before prune deletes anything,
    lets ``name`` be granted: the race a compare-and-delete must win."""
    asked = _prune.redis_held(fencer.redis, fencer.key_prefix)
    granted: dict[str, sa_fence.Lease] = {}

    def held(batch: Sequence[str]) -> Sequence[bool]:
        answer = asked(batch)  # "not held": the grant below comes just after
        if name in batch and name not in granted:
            granted[name] = fencer.acquire(name, 30)
        return answer

    return held, granted


def commit_a_job(lease: sa_fence.Lease, engine: sa.Engine) -> None:
    with sa_fence.install(sessionmaker(engine))() as session:
        lease.bind(session)
        session.add(Job(id=1, result=lease.name))
        session.commit()


def test_a_grant_made_between_the_scan_and_the_delete_survives(
    fencer: sa_fence.Fencer, db: sa.Engine
) -> None:
    grant_and_release(fencer, "job:1", 40)
    grant_and_release(fencer, "job:2", 40)
    held, granted = grant_between_scan_and_delete(fencer, "job:1")
    result = _prune.prune(db, held, SEQUENCE, older_than=30 * DAY, longest_lease=DAY)
    assert (result.rows, result.regranted) == (1, 1)
    assert names(db) == ["job:1"]
    commit_a_job(granted["job:1"], db)  # the new holder commits
    granted["job:1"].release()


@contextlib.contextmanager
def _prune_function_changed(db: sa.Engine, old: str, new: str) -> Iterator[None]:
    """The register's prune function with ``old`` replaced by ``new`` in its body, for a pair;
    sa-fence's own is made again at the end."""
    register = _register.Register(SEQUENCE)
    original = _register._PRUNE_FUNCTION
    assert old in original, "the prune function no longer holds what the pair removes"
    with mock.patch.object(_register, "_PRUNE_FUNCTION", original.replace(old, new)):
        changed = _register.check_function_sql(register)
    with db.begin() as conn:
        conn.execute(sa.text(changed))
    try:
        yield
    finally:
        with db.begin() as conn:
            conn.execute(sa.text(_register.check_function_sql(register)))


def test_without_the_compare_on_the_token_the_grant_in_between_is_deleted(
    fencer: sa_fence.Fencer, db: sa.Engine
) -> None:
    """The pair: deleting by name alone removes the new holder's row, and its
    commits are refused as if its lease were stale."""
    compare = " AND r.token OPERATOR(pg_catalog.=) d.token"
    with _prune_function_changed(db, compare, ""):
        grant_and_release(fencer, "job:1", 40)
        held, granted = grant_between_scan_and_delete(fencer, "job:1")
        _prune.prune(db, held, SEQUENCE, older_than=30 * DAY, longest_lease=DAY)
        assert names(db) == []
        with pytest.raises(sa_fence.StaleTokenError, match="no longer holds its token"):
            commit_a_job(granted["job:1"], db)
        granted["job:1"].release()


@pytest.mark.parametrize("skip_locked", [True, False], ids=["skips", "waits (pair)"])
def test_a_row_locked_by_a_commit_under_way_is_kept_without_waiting(
    fencer: sa_fence.Fencer, db: sa.Engine, skip_locked: bool
) -> None:
    """A commit check holds its register row until its COMMIT ends (a grant or a
    stuck connection may too): prune keeps that row and goes on, never waits."""
    grant_and_release(fencer, "job:1", 40)
    changed = (
        contextlib.nullcontext() if skip_locked else _prune_function_changed(db, " SKIP LOCKED", "")
    )
    dsn = db.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with changed, psycopg.connect(dsn) as committing:
        committing.execute("SELECT 1 FROM sa_fence_leases WHERE name = 'job:1' FOR SHARE")
        # the pair's wait is cut short: lock_timeout on the pruning connection
        engine = sa.create_engine(db.url, connect_args={"options": "-c lock_timeout=500"})
        held = _prune.redis_held(fencer.redis, fencer.key_prefix)
        try:
            if skip_locked:
                result = _prune.prune(
                    engine, held, SEQUENCE, older_than=30 * DAY, longest_lease=DAY
                )
                assert (result.rows, result.regranted) == (0, 1)
            else:
                with pytest.raises(sa.exc.OperationalError, match="lock"):
                    _prune.prune(engine, held, SEQUENCE, older_than=30 * DAY, longest_lease=DAY)
            assert names(db) == ["job:1"]
            committing.rollback()  # the commit ends
            result = _prune.prune(engine, held, SEQUENCE, older_than=30 * DAY, longest_lease=DAY)
            assert result.rows == 1
        finally:
            engine.dispose()


def test_a_stale_holder_of_a_pruned_name_is_refused_and_told_the_name_has_no_row(
    fencer: sa_fence.Fencer, db: sa.Engine
) -> None:
    a = fencer.acquire("job:1", 5)
    session: Session = a.bind(sa_fence.install(sessionmaker(db))())
    session.add(Job(id=1, result="A (stale)"))
    session.flush()
    expire(a)  # A pauses past its TTL; no one takes the name
    age(db, "job:1", 40)
    assert fencer.prune(older_than=30 * DAY, longest_lease=DAY).rows == 1
    with pytest.raises(sa_fence.StaleTokenError) as refused:
        session.commit()
    session.close()
    message = str(refused.value)
    assert refused.value.newest_token is None
    assert (
        f"lease 'job:1' (token {a.token}) is stale: the lease register no longer holds its token"
        in message
    )
    assert "the name's row is gone" in message
    assert "pruned by sa-fence prune" in message
    assert "token none" not in message
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 0
    b = fencer.acquire("job:1", 5)  # the name is granted again, past every token before
    assert b.token > a.token
    commit_a_job(b, db)
    b.release()


# ------------------------------------------------------------ the command


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, " ".join(out.split()), " ".join(err.split())


def test_sa_fence_prune_prints_rows_and_bytes_removed_and_dry_run_deletes_nothing(
    fencer: sa_fence.Fencer,
    db: sa.Engine,
    three_names: sa_fence.Lease,
    key_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = ("--url", url_of(db), "--redis", REDIS_URL, "--key-prefix", key_prefix)
    status, out, err = run_cli(
        capsys, "prune", *common, "--older-than", "30d", "--longest-lease", "1w", "--dry-run"
    )
    assert (status, err) == (0, "")
    assert "rows granted more than 30d ago, not held: would remove 1 register row(s), " in out
    assert "kept 1 held in Redis now" in out
    assert out.endswith("(old enough, but not removed) old:free")  # the name that would go
    assert names(db) == ["new:free", "old:free", "old:held"]
    status, out, _ = run_cli(
        capsys, "prune", *common, "--older-than", "30d", "--longest-lease", "168h"
    )
    assert status == 0
    assert "removed 1 register row(s), " in out
    assert names(db) == ["new:free", "old:held"]


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (
            ["--older-than", "1d", "--longest-lease", "2d"],
            "sa-fence prune: --older-than (1d) is shorter than --longest-lease (2d)",
        ),
        (["--older-than", "30 days", "--longest-lease", "1d"], "not a duration: '30 days'"),
        (["--older-than", "30d"], "the following arguments are required: --longest-lease"),
    ],
)
def test_sa_fence_prune_refuses_bad_ages_with_exit_status_2_and_deletes_nothing(
    db: sa.Engine,
    three_names: sa_fence.Lease,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    problem: str,
) -> None:
    try:
        status, _, err = run_cli(capsys, "prune", "--url", url_of(db), *args)
    except SystemExit as exc:  # argparse's own refusals
        status, err = int(str(exc.code)), " ".join(capsys.readouterr().err.split())
    assert status == 2
    assert problem in err
    assert names(db) == ["new:free", "old:free", "old:held"]


# ------------------------------------------------------------ no stand-ins on the search_path


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned (pair)"])
def test_the_commands_read_the_register_whatever_schema_comes_first_on_the_search_path(
    fencer: sa_fence.Fencer,
    db: sa.Engine,
    key_prefix: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    pinned: bool,
) -> None:
    """check, repair-sequence, status and prune, with a database whose search_path
    puts a schema holding a table ``sa_fence_leases`` first."""
    token = grant_and_release(fencer, "job:1", 40)
    with db.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA shadow"))
        conn.execute(sa.text("CREATE TABLE shadow.sa_fence_leases (LIKE public.sa_fence_leases)"))
        conn.execute(
            sa.text(f'ALTER DATABASE "{db.url.database}" SET search_path = shadow, public')
        )
    if not pinned:
        monkeypatch.setattr(_register.Register, "pinned", lambda self, schema: self)
    status, out, _ = run_cli(capsys, "check", "--url", url_of(db))
    assert ("ok lease register sa_fence_leases: tokens from sa_fence_token_seq" in out) is pinned
    execute(db, f"SELECT setval('{SEQUENCE}', 1, false)")  # set back below the register
    status, out, _ = run_cli(
        capsys, "repair-sequence", "--url", url_of(db), "--margin", "0", "--yes"
    )
    assert (f"largest registered token {token} " in out) is pinned
    common = ("--url", url_of(db), "--redis", REDIS_URL, "--key-prefix", key_prefix)
    status, out, _ = run_cli(capsys, "status", *common, "--json")
    assert ("job:1" in out) is pinned
    status, out, _ = run_cli(
        capsys, "prune", *common, "--older-than", "30d", "--longest-lease", "1d"
    )
    assert status == 0
    assert (names(db) == []) is pinned


def test_a_dry_run_lists_the_first_names_and_counts_the_rest(
    fencer: sa_fence.Fencer, db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run over more rows than it lists names the first ones in name order and
    says how many more would go; the count covers them all, across batches."""
    monkeypatch.setattr(_prune, "NAMES_LISTED", 2)
    for n in (3, 1, 2):
        grant_and_release(fencer, f"gone:{n}", 40)
    result = _prune.prune(
        db,
        lambda names: [False] * len(names),
        SEQUENCE,
        older_than=30 * DAY,
        longest_lease=7 * DAY,
        dry_run=True,
        batch=2,
    )
    assert (result.rows, result.names) == (3, ("gone:1", "gone:2"))
    assert _cli_prune.would_go(result) == ["  gone:1", "  gone:2", "  ... and 1 more"]
    assert names(db) == ["gone:1", "gone:2", "gone:3"]  # nothing deleted
