"""A cron-style script: one run at a time, a hung run gives the name back.

Create the table, the token sequence and the lease register once::

    python -c 'import cron_job; cron_job.create_tables()'

then, from cron, every minute::

    * * * * *  cd /srv/app && python cron_job.py

A run that starts while the previous one still works exits 0 saying it
skipped; ``max_hold`` bounds how long one run may keep renewing the lease
(a hung run is then refused its writes and the next run can take over).  The
configuration comes from ``DATABASE_URL``, ``REDIS_URL`` and
``SA_FENCE_KEY_PREFIX``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import redis
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

import sa_fence

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/app")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("SA_FENCE_KEY_PREFIX", "sa_fence:")
WORK_SECONDS = float(os.environ.get("WORK_SECONDS", "0"))  # stands for the real work


class Base(DeclarativeBase):
    pass


class DailyReport(sa_fence.Fenced, Base):
    __tablename__ = "cron_reports"

    day: Mapped[str] = mapped_column(primary_key=True)
    total: Mapped[int]


sa_fence.fence_schema(Base.metadata)

engine = sa.create_engine(DATABASE_URL)
Session = sa_fence.install(sessionmaker(engine))
fencer = sa_fence.Fencer(
    redis.Redis.from_url(REDIS_URL, socket_timeout=5), engine, key_prefix=KEY_PREFIX
)


def create_tables() -> None:
    """The table, the token sequence and the lease register, when missing (or: Alembic)."""
    Base.metadata.create_all(engine)


@sa_fence.fenced(
    "report:{day}",
    ttl=30,
    renew=True,
    max_hold=15 * 60,  # a run that still works after 15 minutes is hung: let it go
    on_busy="skip",
    fencer=fencer,
    session=Session,
)
def refresh_report(day: str) -> int:
    """Recompute the day's report; returns the token it was written with."""
    time.sleep(WORK_SECONDS)
    session = sa_fence.current_session()
    total = session.scalar(sa.select(sa.func.count()).select_from(DailyReport)) or 0
    session.merge(DailyReport(day=day, total=int(total)))
    return int(sa_fence.current_lease().token)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    day = argv[1] if len(argv) > 1 else time.strftime("%Y-%m-%d")
    try:
        token = refresh_report(day)
    except sa_fence.FenceError as exc:  # lost, stale or a backend failure: nothing committed
        print(f"report {day}: not written: {exc}", file=sys.stderr)
        return 1
    finally:
        fencer.close()
        engine.dispose()
    if token == sa_fence.SKIPPED:
        print(f"report {day}: another run is working on it; skipped")
        return 0
    print(f"report {day}: written with token {token}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
