"""Celery: a fenced task that a stalled, redelivered worker cannot overwrite.

Create the table, the token sequence and the lease register once::

    python -c 'import celery_tasks; celery_tasks.create_tables()'

start a worker from the folder of this file::

    celery -A celery_tasks worker --loglevel=INFO

and send work from anywhere that imports it::

    from celery_tasks import finish_job
    token = finish_job.delay(42, "done").get(timeout=30)

The configuration comes from the environment: ``DATABASE_URL``,
``REDIS_URL`` (the leases), ``CELERY_BROKER_URL`` and
``CELERY_RESULT_BACKEND`` (default: ``REDIS_URL``).
"""

from __future__ import annotations

import os
import time

import redis
import sqlalchemy as sa
from celery import Celery, Task
from celery.signals import worker_process_init
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

import sa_fence

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/app")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("SA_FENCE_KEY_PREFIX", "sa_fence:")
#: Longer than the work normally takes; renewal keeps a longer run alive.
JOB_TTL = float(os.environ.get("JOB_TTL", "30"))
#: With acks_late, a task not acknowledged within this many seconds is given
#: to another worker: the case fencing exists for (a worker that stalled).
VISIBILITY_TIMEOUT = float(os.environ.get("VISIBILITY_TIMEOUT", "3600"))


class Base(DeclarativeBase):
    pass


class Job(sa_fence.Fenced, Base):
    __tablename__ = "celery_jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    result: Mapped[str | None]


sa_fence.fence_schema(Base.metadata)

engine = sa.create_engine(DATABASE_URL)
Session = sa_fence.install(sessionmaker(engine))
fencer = sa_fence.Fencer(
    redis.Redis.from_url(REDIS_URL, socket_timeout=5), engine, key_prefix=KEY_PREFIX
)


def create_tables() -> None:
    """The table, the token sequence and the lease register, when missing.

    Run once, before the first worker starts (or use Alembic: see migrations).
    """
    Base.metadata.create_all(engine)


app = Celery(
    "celery_tasks",
    broker=os.environ.get("CELERY_BROKER_URL", REDIS_URL),
    backend=os.environ.get("CELERY_RESULT_BACKEND", REDIS_URL),
)
app.conf.update(
    task_acks_late=True,  # acknowledged when done: redelivered if the worker dies or stalls
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_restore_interval": 1,  # look for stalled tasks every second
        "unacked_restore_throttle": 1,
    },
    broker_connection_retry_on_startup=True,
)


@worker_process_init.connect
def _own_connections(**_: object) -> None:
    # prefork pool: a child must not share the parent's pooled connections
    engine.dispose(close=False)


@app.task(bind=True)
@sa_fence.fenced("job:{job_id}", ttl=JOB_TTL, renew=True, fencer=fencer, session=Session)
def finish_job(self: Task, job_id: int, result: str, work_seconds: float = 0.0) -> int:
    """Compute job ``job_id``'s result and store it; return the lease token it carries.

    The decorator opens a session from ``Session``, binds the lease to it,
    commits when this returns and closes it: task arguments stay plain JSON.
    """
    time.sleep(work_seconds)  # stands for the real work
    session = sa_fence.current_session()
    job = session.get(Job, job_id) or Job(id=job_id)
    job.result = f"{result} (by {self.request.hostname})"
    session.add(job)
    return int(sa_fence.current_lease().token)


@app.task
@sa_fence.fenced("job:{job_id}", ttl=JOB_TTL, on_busy="skip", fencer=fencer, session=Session)
def finish_job_unless_busy(job_id: int, result: str) -> int | sa_fence.Skipped:
    """As finish_job, but returns ``sa_fence.SKIPPED`` when another worker holds the job."""
    session = sa_fence.current_session()
    job = session.get(Job, job_id) or Job(id=job_id)
    job.result = result
    session.add(job)
    return int(sa_fence.current_lease().token)
