"""FastAPI: a dependency that yields a session fenced by the job's lease.

Run it with ``uvicorn fastapi_app:app`` from the folder of this file; it
creates its table, the token sequence and the lease register at start-up
when they are missing.  The configuration comes from ``DATABASE_URL``,
``REDIS_URL`` and ``SA_FENCE_KEY_PREFIX``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated

import redis
import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import sa_fence

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/app")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("SA_FENCE_KEY_PREFIX", "sa_fence:")


class Base(DeclarativeBase):
    pass


class Job(sa_fence.Fenced, Base):
    __tablename__ = "api_jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    result: Mapped[str | None]


sa_fence.fence_schema(Base.metadata)

engine = sa.create_engine(DATABASE_URL)
# expire_on_commit=False: the endpoint reads the row after its commit
SessionLocal = sa_fence.install(sessionmaker(engine, expire_on_commit=False))
fencer = sa_fence.Fencer(
    redis.Redis.from_url(REDIS_URL, socket_timeout=5), engine, key_prefix=KEY_PREFIX
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # The table, the token sequence and the lease register, when missing.  An
    # application with Alembic migrations runs `alembic upgrade head` instead.
    Base.metadata.create_all(engine)
    yield
    fencer.close()
    engine.dispose()


app = FastAPI(lifespan=lifespan)


def fenced_job_session(job_id: int) -> Iterator[Session]:
    """A session bound to lease ``job:<job_id>`` for one request.

    409 when another holder works on the job.  The endpoint commits; on the
    way out the session is closed (rolled back if it did not commit) and the
    lease released.  A sync dependency: FastAPI runs it in its thread pool.
    """
    try:
        lease = fencer.acquire(f"job:{job_id}", ttl=30, renew=True)
    except sa_fence.LeaseNotAcquiredError as exc:
        raise HTTPException(409, f"job {job_id} is being worked on elsewhere") from exc
    try:
        with SessionLocal() as session:
            lease.bind(session)
            yield session
    finally:
        lease.release()


FencedSession = Annotated[Session, Depends(fenced_job_session)]


@app.exception_handler(sa_fence.StaleTokenError)
def stale_write(request: Request, exc: sa_fence.StaleTokenError) -> JSONResponse:
    # A newer holder of the job's lease came first: nothing was committed.
    return JSONResponse(status_code=409, content={"detail": str(exc)})


class JobResult(BaseModel):
    result: str


class JobOut(BaseModel):
    id: int
    result: str | None
    fence: int


@app.put("/jobs/{job_id}")
def finish_job(job_id: int, body: JobResult, session: FencedSession) -> JobOut:
    job = session.get(Job, job_id) or Job(id=job_id)
    job.result = body.result
    session.add(job)
    session.commit()  # StaleTokenError -> 409 (the handler above)
    return JobOut(id=job.id, result=job.result, fence=job.fence)
