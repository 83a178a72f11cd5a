"""Checked by mypy in tests/project/test_typing.py, never run: what users' type checkers see."""

from typing import reveal_type

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, sessionmaker

import sa_fence


@sa_fence.fenced("job:{job_id}", ttl=5, on_busy="skip")
async def finish_async(job_id: int) -> str:
    return "done"


@sa_fence.fenced("job:{job_id}", ttl=5, on_busy="skip")
def finish(job_id: int) -> int:
    return job_id


@sa_fence.fenced("job:{job_id}", ttl=5)
def finish_or_raise(job_id: int) -> str:
    return "done"


async def main(maker: sessionmaker[Session]) -> None:
    reveal_type(await finish_async(1))
    reveal_type(finish(1))
    reveal_type(finish_or_raise(1))
    reveal_type(sa_fence.install(maker))


def bind_async(lease: sa_fence.Lease, session: AsyncSession) -> None:
    reveal_type(lease.bind(session))  # a sync Lease fences an AsyncSession too (issue 49)
