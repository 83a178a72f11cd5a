"""Side effects from current holders only: a webhook per finished job, on procrastinate.

``finish()`` writes a job's result and, in the same transaction, enqueues the
webhook that announces it (``sa_fence.side_effect``).  A stale holder's
commit is refused, and its webhook job with it; the current holder's row
and webhook job commit together.  A procrastinate worker delivers the job at
least once, with the same ``Idempotency-Key`` on every attempt, and the
receiver (``make_receiver``, a WSGI app) applies each key once.

Create the tables once, then run the worker with procrastinate's own command::

    python -c 'import side_effects; side_effects.create_tables()'  # jobs, sequence, register
    procrastinate --app=side_effects.app schema --apply   # the queue's tables
    procrastinate --app=side_effects.app worker            # Ctrl-C / SIGTERM stops it cleanly

The configuration comes from ``DATABASE_URL`` (the database of the fenced
rows, the lease register and the queue), ``REDIS_URL`` and
``SA_FENCE_KEY_PREFIX``.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

import procrastinate
import redis
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

import sa_fence

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/app")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("SA_FENCE_KEY_PREFIX", "sa_fence:")


class Base(DeclarativeBase):
    pass


class Job(sa_fence.Fenced, Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    result: Mapped[str | None]


sa_fence.fence_schema(Base.metadata)

engine = sa.create_engine(DATABASE_URL)
Session = sa_fence.install(sessionmaker(engine))
fencer = sa_fence.Fencer(
    redis.Redis.from_url(REDIS_URL, socket_timeout=5), engine, key_prefix=KEY_PREFIX
)


def create_tables() -> None:
    """The table ``jobs``, the token sequence and the lease register, when missing.

    Run once (or use Alembic: see migrations); the queue's tables come from
    ``procrastinate --app=side_effects.app schema --apply``.
    """
    Base.metadata.create_all(engine)


# The queue lives in the same database: procrastinate takes a libpq URL.
app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(
        conninfo=engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    )
)


# A name of its own: the enqueuing process and the worker may import this
# module under different names.  Retried 8 times with exponential backoff
# (2, 4, 8, ... s); after the last retry the job stays "failed", the
# dead-letter state (`procrastinate --app=side_effects.app shell list_jobs
# status=failed`, given back to the queue by `shell retry JOB_ID`).
@app.task(name="notify", retry=procrastinate.RetryStrategy(max_attempts=8, exponential_wait=2))
def notify(webhook_url: str, job_id: int, result: str, idempotency_key: str) -> None:
    request = urllib.request.Request(
        webhook_url,
        data=json.dumps({"job": job_id, "result": result}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # raises on 4xx/5xx
        response.read()


#: A worker's heartbeat older than this (procrastinate's workers send one every
#: 10 s) means the worker is gone: its jobs in the "doing" state are stalled.
STALLED_AFTER_SECONDS = 30


# A worker killed mid-job (SIGKILL, a lost host) leaves its job "doing".  Every
# 5 minutes this task gives back to the queue the jobs of workers whose heartbeat
# is older than STALLED_AFTER_SECONDS: a killed worker's job is retried within
# about 5.5 minutes (run it more often to retry sooner).  The retry carries the
# same key.
@app.periodic(cron="*/5 * * * *")
@app.task(name="retry_stalled_jobs", queueing_lock="retry_stalled_jobs", pass_context=True)
async def retry_stalled_jobs(context: procrastinate.JobContext, timestamp: int) -> None:
    stalled = await context.app.job_manager.get_stalled_jobs(
        seconds_since_heartbeat=STALLED_AFTER_SECONDS
    )
    for job in stalled:
        await context.app.job_manager.retry_job(job)


def finish(job_id: int, result: str, webhook_url: str) -> str:
    """Write the job's result and announce it; returns the webhook's idempotency key."""
    with fencer.acquire(f"job:{job_id}", ttl=30) as lease, Session() as session:
        lease.bind(session)
        session.get_one(Job, job_id).result = result
        effect = sa_fence.side_effect(
            session, notify, webhook_url=webhook_url, job_id=job_id, result=result
        )
        session.commit()  # the row and its webhook job, or neither (StaleTokenError)
    return effect.idempotency_key


# ---------------------------------------------------------------- the receiver

#: In the receiving service's own database: the keys it has applied.
receipts = sa.Table(
    "webhook_receipts",
    sa.MetaData(),
    sa.Column("idempotency_key", sa.Text, primary_key=True),
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("result", sa.Text, nullable=False),
    sa.Column("received_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
)


def receive(receiver_engine: sa.Engine, idempotency_key: str, payload: dict[str, Any]) -> bool:
    """Apply one webhook once per key: True if applied now, False for a repeat."""
    with receiver_engine.begin() as conn:
        applied = conn.execute(
            insert(receipts)
            .values(
                idempotency_key=idempotency_key, job_id=payload["job"], result=payload["result"]
            )
            .on_conflict_do_nothing()
            .returning(receipts.c.idempotency_key)
        ).first()
        # ...the effect itself (a row, a charge) goes here, in the same transaction.
    return applied is not None


def make_receiver(receiver_engine: sa.Engine) -> Callable[..., Iterable[bytes]]:
    """The receiving endpoint as a WSGI app: 201 when applied, 200 for a repeat.

    Creates its table, ``webhook_receipts``, when missing.
    """
    receipts.create(receiver_engine, checkfirst=True)

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        key = environ.get("HTTP_IDEMPOTENCY_KEY")
        if not key:
            start_response("400 Bad Request", [("Content-Type", "text/plain")])
            return [b"an Idempotency-Key header is required\n"]
        size = int(environ.get("CONTENT_LENGTH") or 0)
        payload = json.loads(environ["wsgi.input"].read(size))
        applied = receive(receiver_engine, key, payload)
        start_response("201 Created" if applied else "200 OK", [("Content-Length", "0")])
        return [b""]

    return wsgi
