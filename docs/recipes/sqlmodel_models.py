"""SQLModel: a ``table=True`` model with the fence, written under a lease.

``sa_fence.Fenced`` goes first among the bases.  Its ``fence`` column is a
mapped column, not a pydantic field: it is not a constructor argument nor in
``model_dump()``, and ``job.fence`` reads the token the row carries.
``python sqlmodel_models.py`` creates the table, the token sequence and the
lease register when missing, then writes job 1 twice.  The configuration
comes from ``DATABASE_URL``, ``REDIS_URL`` and ``SA_FENCE_KEY_PREFIX``.
"""

from __future__ import annotations

import os

import redis
from sqlalchemy.orm import sessionmaker
from sqlmodel import Field, Session, SQLModel, create_engine

import sa_fence

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/app")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("SA_FENCE_KEY_PREFIX", "sa_fence:")


class Job(sa_fence.Fenced, SQLModel, table=True):
    __tablename__ = "sqlmodel_jobs"

    id: int | None = Field(default=None, primary_key=True)
    result: str | None = None


sa_fence.fence_schema(SQLModel.metadata)  # the token sequence and the lease register

engine = create_engine(DATABASE_URL)
# SQLModel's own Session class, from a sessionmaker that has the hook
Sessions = sa_fence.install(sessionmaker(engine, class_=Session, expire_on_commit=False))
fencer = sa_fence.Fencer(
    redis.Redis.from_url(REDIS_URL, socket_timeout=5), engine, key_prefix=KEY_PREFIX
)


def create_tables() -> None:
    """The table, the token sequence and the lease register, when missing (or: Alembic)."""
    SQLModel.metadata.create_all(engine)


def finish_job(job_id: int, result: str) -> Job:
    """Store job ``job_id``'s result under its lease; the row's fence is the lease's token."""
    with fencer.acquire(f"job:{job_id}", ttl=30) as lease, Sessions() as session:
        lease.bind(session)
        job = session.get(Job, job_id) or Job(id=job_id)
        job.result = result
        session.add(job)
        session.commit()
        session.refresh(job)  # load the fence the row got (the lease's token) while open
        return job


if __name__ == "__main__":
    create_tables()
    for result in ("first", "second"):
        job = finish_job(1, result)
        print(f"job {job.id}: result={job.result!r}, fence={job.fence}")
    fencer.close()
