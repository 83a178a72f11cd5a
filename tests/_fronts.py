"""Run a lifecycle test against both front ends: the sync Fencer and the AsyncFencer.

A test takes the ``front`` fixture (parametrized "sync" / "async"; same Redis
prefix, same database) and is an ``async def``; every call that does I/O on
the async side goes through :func:`io`, which awaits it there and passes the
sync result through::

    async def test_release_is_idempotent(front: Any) -> None:
        lease = await io(front.acquire("job:1", 30))
        assert await io(lease.release()) is True

Both fencers share the lifecycle (sa_fence/lease/lifecycle.py), so a guard removed
from it fails the sync and the async case alike; the async case also covers
the driver's own I/O (awaits, greenlet, shielded clean-ups).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

import sa_fence

FRONT_ENDS = ["sync", "async"]


@pytest.fixture(params=FRONT_ENDS)
def front(request: pytest.FixtureRequest) -> Any:
    """The front end under test: the sync Fencer or the AsyncFencer."""
    return request.getfixturevalue("fencer" if request.param == "sync" else "afencer")


def is_async(front: Any) -> bool:
    return isinstance(front, sa_fence.AsyncFencer)


async def io(result: Any) -> Any:
    """``result`` awaited when it is awaitable (the async front end), else as it is."""
    if inspect.isawaitable(result):
        return await result
    return result


@asynccontextmanager
async def entered(manager: Any) -> AsyncIterator[Any]:
    """``manager`` entered as its front end enters it (``async with`` / ``with``):
    ``async with entered(front.acquire("job:1", 5)) as lease: ...``."""
    if hasattr(manager, "__aenter__"):
        async with manager as value:
            yield value
    else:
        with manager as value:
            yield value
