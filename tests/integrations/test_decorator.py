"""@fenced and @fenced_methods on a repository, on real servers."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from tests.models import Job


def job(engine: sa.Engine, job_id: int) -> tuple[Any, ...] | None:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT result, fence FROM jobs WHERE id = :id"), {"id": job_id}
        ).one_or_none()
    return None if found is None else tuple(found)


@dataclass
class JobRepository:
    session: Session
    fencer: sa_fence.Fencer

    @sa_fence.fenced("job:{job_id}", ttl=30)
    def finish(self, job_id: int, result: str) -> int:
        self.session.merge(Job(id=job_id, result=result))
        return sa_fence.current_lease().token

    @sa_fence.fenced("job:{job_id}", ttl=30)
    def fail_midway(self, job_id: int) -> None:
        self.session.merge(Job(id=job_id, result="half done"))
        self.session.flush()
        raise RuntimeError("the job failed")

    @sa_fence.fenced("job:{job_id}", ttl=30, on_busy="skip")
    def finish_unless_busy(self, job_id: int) -> str:
        self.session.merge(Job(id=job_id, result="not skipped"))
        return "ran"

    @sa_fence.fenced("job:{job_id}", ttl=30, on_busy="wait", timeout=5)
    def finish_when_free(self, job_id: int) -> None:
        self.session.merge(Job(id=job_id, result="waited"))


@pytest.fixture
def repo(make_session: sessionmaker[Session], fencer: sa_fence.Fencer) -> Any:
    with make_session() as session:
        yield JobRepository(session, fencer)


def test_a_fenced_repository_method_writes_under_the_lease_named_from_its_arguments(
    repo: JobRepository, engine: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    seen: list[bytes] = []
    original = repo.fencer._acquire

    def spy(keys: list[str], args: list[Any]) -> Any:
        seen.extend(k.encode() for k in keys)
        return original(keys=keys, args=args)

    repo.fencer._acquire = spy  # type: ignore[assignment]
    token = repo.finish(7, result="done")
    assert seen == [f"{key_prefix}job:7".encode()]
    assert job(engine, 7) == ("done", token)  # committed, with the lease's token
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []  # released
    assert sa_fence.orm.session_state.state_of(repo.session).lease is None  # unbound again
    with pytest.raises(LookupError, match=r"outside a @sa_fence\.fenced call"):
        sa_fence.current_lease()


def test_a_fenced_method_that_raises_is_rolled_back_and_its_lease_released(
    repo: JobRepository, engine: sa.Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    with pytest.raises(RuntimeError, match="the job failed"):
        repo.fail_midway(job_id=8)
    assert not repo.session.in_transaction()  # nothing of the call left to commit
    repo.session.commit()  # the caller's next commit: the half-done row is not in it
    assert job(engine, 8) is None
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []


def test_contention_raises_by_default(repo: JobRepository, engine: sa.Engine) -> None:
    with repo.fencer.acquire("job:9", 30) as held:
        with pytest.raises(sa_fence.LeaseNotAcquiredError) as busy:
            repo.finish(9, "x")
        assert busy.value.holder_token == held.token
    assert job(engine, 9) is None


def test_contention_with_on_busy_skip_returns_the_sentinel_without_running_the_body(
    repo: JobRepository, engine: sa.Engine
) -> None:
    with repo.fencer.acquire("job:10", 30):
        assert repo.finish_unless_busy(10) is sa_fence.SKIPPED
    assert job(engine, 10) is None
    assert repo.finish_unless_busy(10) == "ran"
    assert job(engine, 10)[0] == "not skipped"  # type: ignore[index]


def test_contention_with_on_busy_wait_runs_once_the_holder_lets_go(
    repo: JobRepository, engine: sa.Engine
) -> None:
    held = repo.fencer.acquire("job:11", 30)
    threading.Timer(0.3, held.release).start()
    started = time.monotonic()
    repo.finish_when_free(11)
    assert time.monotonic() - started >= 0.25
    assert job(engine, 11)[0] == "waited"  # type: ignore[index]


def test_the_session_keeps_its_previous_lease_after_a_nested_fenced_call(
    repo: JobRepository, fencer: sa_fence.Fencer
) -> None:
    with fencer.acquire("outer", 30) as outer:
        outer.bind(repo.session)
        repo.finish(12, "inner")
        assert sa_fence.orm.session_state.state_of(repo.session).lease is outer


def test_fencer_and_session_can_be_named_parameters_or_given_explicitly(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session], engine: sa.Engine
) -> None:
    @sa_fence.fenced("job:{job.id}", ttl=30, fencer=fencer, session="db")
    def save(db: Session, job: Job) -> None:
        db.merge(job)

    with make_session() as db:
        save(db, Job(id=13, result="by parameter"))
    assert job(engine, 13)[0] == "by parameter"  # type: ignore[index]


def test_fenced_methods_fences_every_public_method_of_a_repository(
    make_session: sessionmaker[Session], fencer: sa_fence.Fencer, engine: sa.Engine
) -> None:
    @sa_fence.fenced_methods("job:{job_id}", ttl=30, exclude=["count"])
    class Jobs:
        def __init__(self, session: Session, fencer: sa_fence.Fencer) -> None:
            self.session = session
            self.fencer = fencer

        def put(self, job_id: int, result: str) -> str:
            self.session.merge(Job(id=job_id, result=result))
            return sa_fence.current_lease().name

        def count(self) -> int:
            return self.session.query(Job).count()

        @sa_fence.fenced("other:{job_id}", ttl=30)
        def put_other(self, job_id: int) -> str:
            return sa_fence.current_lease().name

        def _helper(self) -> None:
            raise AssertionError("private methods are left alone")

    with make_session() as session:
        jobs = Jobs(session, fencer)
        assert jobs.put(14, "fenced") == "job:14"
        assert jobs.put_other(14) == "other:14"  # its own decorator wins
        assert jobs.count() == 1  # excluded: no lease needed
        with fencer.acquire("job:15", 30), pytest.raises(sa_fence.LeaseNotAcquiredError):
            jobs.put(15, "busy")
    assert job(engine, 14)[0] == "fenced"  # type: ignore[index]


def test_an_unfenced_write_through_the_same_repository_is_still_refused(
    make_session: sessionmaker[Session],
) -> None:
    """The pair: without the decorator the session has no lease and may not write."""
    with make_session() as session:
        session.merge(Job(id=16, result="no lease"))
        with pytest.raises(sa_fence.UnfencedWriteError):
            session.commit()


@pytest.mark.parametrize(
    ("template", "kwargs", "error", "match"),
    [
        ("job:{jobid}", {}, ValueError, r"uses 'jobid', which .*f\(\) has no parameter"),
        ("job:{}", {}, ValueError, "positional field"),
        ("job:{job_id", {}, ValueError, "not a valid format string"),
        ("", {}, ValueError, "template is empty"),
        (42, {}, TypeError, "must be a str"),
        ("job:{job_id}", {"ttl": -1}, ValueError, "ttl must be a finite number"),
        ("job:{job_id}", {"on_busy": "retry"}, ValueError, "on_busy must be one of"),
        ("job:{job_id}", {"timeout": 5}, ValueError, "applies only with on_busy='wait'"),
        ("job:{job_id}", {"on_busy": "wait", "timeout": -1}, ValueError, "timeout must be"),
        ("job:{job_id}", {"fencer": 3}, TypeError, "fencer must be a Fencer or the name"),
        ("job:{job_id}", {"session": "not a name"}, TypeError, "session must be a Session"),
        ("job:{job_id}", {"renew": 1}, TypeError, "renew must be True or False"),
        ("job:{job_id}", {"on_lost": "print"}, TypeError, "on_lost must be a callable"),
        ("job:{job_id}", {"fail_fast": "no"}, TypeError, "fail_fast must be True, False or None"),
    ],
)
def test_bad_decorator_arguments_are_refused_at_decoration_time(
    template: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    def f(self: Any, job_id: int) -> None: ...

    with pytest.raises(error, match=match):
        sa_fence.fenced(template, **{"ttl": 30, **kwargs})(f)


def test_a_generator_or_an_async_callable_object_is_refused_at_decoration_time() -> None:
    """Their bodies would run after the call returned: committed, released, unfenced."""

    def rows(job_id: int) -> Iterator[int]:
        yield job_id

    async def arows(job_id: int) -> AsyncIterator[int]:
        yield job_id

    class Handler:
        async def __call__(self, job_id: int) -> None: ...

    for fn in (rows, arows):
        with pytest.raises(TypeError, match=r"cannot wrap .*rows, a generator function"):
            sa_fence.fenced("job:{job_id}", ttl=30)(fn)
    with pytest.raises(TypeError, match=r"its __call__ is an async def"):
        sa_fence.fenced("job:{job_id}", ttl=30)(Handler())

    class Repository:
        def scan(self, job_id: int) -> Iterator[int]:
            yield job_id

    with pytest.raises(TypeError, match=r"Repository.scan, a generator .*exclude="):
        sa_fence.fenced_methods("job:{job_id}", ttl=30)(Repository)
    sa_fence.fenced_methods("job:{job_id}", ttl=30, exclude=["scan"])(Repository)


def test_a_missing_fencer_or_a_name_that_does_not_fit_fails_before_anything_is_written(
    make_session: sessionmaker[Session],
    fencer: sa_fence.Fencer,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    class NoFencer:
        def __init__(self, session: Session) -> None:
            self.session = session

        @sa_fence.fenced("job:{job_id}", ttl=30)
        def put(self, job_id: Any) -> None: ...

    with make_session() as session:
        with pytest.raises(TypeError, match="could not find the fencer"):
            NoFencer(session).put(1)
        repo = JobRepository(session, fencer)
        with pytest.raises(ValueError, match="lease name must be 1 to 1024"):
            repo.finish("x" * 2000, "too long")
    with pytest.raises(ValueError, match="exclude names"):
        sa_fence.fenced_methods("job:{job_id}", ttl=30, exclude=["nope"])(JobRepository)
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []


def test_a_fencer_session_or_name_found_wrong_at_the_call_fails_before_anything_is_written(
    make_session: sessionmaker[Session],
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """What the decorator can only find at the call (an attribute, a parameter, what a factory
    returns) is checked before the acquire, with an error naming it; a factory's wrong-kind
    result that can be closed is closed."""

    @dataclass
    class Repository:
        session: Any
        fencer: Any

        @sa_fence.fenced("job:{job.id}", ttl=30)
        def by_job(self, job: Any) -> None:
            self.session.merge(Job(id=job.id, result="written"))

    opened: list[sa.Connection] = []

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=lambda: opened[-1])
    def from_a_factory(job_id: int) -> None: ...

    @sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=make_session)
    def by_id(job_id: int | None) -> None: ...

    with make_session() as session:
        with pytest.raises(
            ValueError, match=r"could not fill lease name template 'job:\{job\.id\}' from .*by_job"
        ):
            Repository(session, fencer).by_job(None)
        with pytest.raises(ValueError, match=r"by_job\(\): \{job\.id\} is None"):
            Repository(session, fencer).by_job(Job(id=None))  # not one lease "job:None" for all
        with pytest.raises(ValueError, match=r"'job:\{job_id\}' .*by_id\(\): \{job_id\} is None"):
            by_id(None)
        with pytest.raises(TypeError, match="found fencer 'fencer' but it is a str, not a Fencer"):
            Repository(session, "not a fencer").by_job(Job(id=1))
        with pytest.raises(TypeError, match="found session 'session' but it is a int, not a Sess"):
            Repository(42, fencer).by_job(Job(id=1))
    opened.append(engine.connect())  # a Connection where a Session was due
    with pytest.raises(TypeError, match=r"session factory .* returned a Connection, not a Sess"):
        from_a_factory(1)
    assert opened[-1].closed
    assert list(redis_client.scan_iter(match=key_prefix + "*")) == []
    assert job(engine, 1) is None
