"""What every benchmark section shares: settings, the temporary database, targets."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
import sqlalchemy as sa

DEFAULT_PG = os.environ.get("SA_FENCE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
DEFAULT_REDIS = os.environ.get("SA_FENCE_TEST_REDIS", "redis://127.0.0.1:6379/0")


@dataclass
class Config:
    rounds: int = 10
    rows: int = 1000
    quick: bool = False  # the smoke run: tiny counts, numbers meaningless
    memory_cycles: int = 100_000
    workers: int = 8
    jobs: int = 200


@dataclass
class Target:
    name: str
    value: float
    limit: float
    unit: str
    why_missed: str = ""  # printed under a MISS: the profiled cause
    decimals: int = 3  # counts (calls, writes) are printed as whole numbers

    @property
    def met(self) -> bool:
        return self.value <= self.limit


def admin_dsn(server: sa.URL) -> str:
    url = server.set(database="postgres", drivername="postgresql")
    return url.render_as_string(hide_password=False)


@contextmanager
def temporary_database(server: sa.URL) -> Iterator[sa.URL]:
    """A database of our own, dropped afterwards (also when the benchmark fails)."""
    name = f"sa_fence_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn(server), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server.set(database=name)
    finally:
        with psycopg.connect(admin_dsn(server), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
