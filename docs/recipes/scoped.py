"""``scoped_session``: threads that each use their own session, fenced per job.

The decorator takes the scoped session itself: each call runs on the
calling thread's current session (``Session()``), binds the job's lease to
it, commits and leaves it open for the thread; the thread removes it when
it is done.  ``python scoped.py`` creates the table, the token sequence and
the lease register when missing, then finishes eight jobs in four threads.
The configuration comes from ``DATABASE_URL``, ``REDIS_URL`` and
``SA_FENCE_KEY_PREFIX``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import redis
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, scoped_session, sessionmaker

import sa_fence

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/app")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("SA_FENCE_KEY_PREFIX", "sa_fence:")


class Base(DeclarativeBase):
    pass


class Job(sa_fence.Fenced, Base):
    __tablename__ = "scoped_jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    result: Mapped[str | None]


sa_fence.fence_schema(Base.metadata)

engine = sa.create_engine(DATABASE_URL)
Session = scoped_session(sessionmaker(engine))
sa_fence.install(Session)  # on its session_factory
fencer = sa_fence.Fencer(
    redis.Redis.from_url(REDIS_URL, socket_timeout=5), engine, key_prefix=KEY_PREFIX
)


def create_tables() -> None:
    """The table, the token sequence and the lease register, when missing (or: Alembic)."""
    Base.metadata.create_all(engine)


@sa_fence.fenced("job:{job_id}", ttl=30, renew=True, fencer=fencer, session=Session)
def finish_job(job_id: int, result: str) -> int:
    job = Session.get(Job, job_id) or Job(id=job_id)  # this thread's session
    job.result = result
    Session.add(job)
    return int(sa_fence.current_lease().token)


def work(job_ids: list[int]) -> list[int]:
    """Finish each job in a pool of threads; each thread's session is removed at its end."""

    def one(job_id: int) -> int:
        try:
            return finish_job(job_id, f"result {job_id}")
        finally:
            Session.remove()

    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(one, job_ids))


if __name__ == "__main__":
    create_tables()
    tokens = work(list(range(1, 9)))
    print(f"{len(set(tokens))} jobs written by 4 threads, each with its own lease's token")
    fencer.close()
