"""mypy --strict, as a user: sa_fence.side_effect (tests/project/test_typing_side_effects.py)."""

from __future__ import annotations

from typing import reveal_type

import procrastinate
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import sa_fence

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=""))


@app.task(name="notify")
def notify(url: str, body: dict[str, int], idempotency_key: str) -> None:
    pass


def enqueue(session: Session) -> str:
    effect = sa_fence.side_effect(session, notify, url="http://x.invalid", body={"n": 1})
    reveal_type(effect)
    return effect.idempotency_key


async def enqueue_async(session: AsyncSession) -> int:
    effect = await sa_fence.side_effect_async(session, notify, url="u", body={"n": 1})
    return effect.job_id


def refused(session: Session, async_session: AsyncSession) -> None:
    # --strict warns about unused ignores: each line below must be an error.
    sa_fence.side_effect(session, len)  # type: ignore[arg-type]
    sa_fence.side_effect(async_session, notify)  # type: ignore[arg-type]
