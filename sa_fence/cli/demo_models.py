"""The demo's ORM models: two fenced tables, ``jobs`` and ``job_steps``.

Not library code: the models ``sa-fence demo`` plays its story on, and the
ones ``migrations/`` (the repository's example migrations, shipped in the
wheel for the demo) create.  ``sa-fence check --metadata
sa_fence.cli.demo_models:DemoBase`` checks a database made by them.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ..db.tokens import fence_schema
from ..orm.model import Fenced


class DemoBase(DeclarativeBase):
    pass


fence_schema(DemoBase.metadata)


class DemoJob(Fenced, DemoBase):
    """The protected row: one job and the result of whoever processed it."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    result: Mapped[str | None] = mapped_column(sa.String(200))


class DemoStep(Fenced, DemoBase):
    """A second fenced table (composite key) that migrations/ also creates and guards."""

    __tablename__ = "job_steps"

    job_id: Mapped[int] = mapped_column(primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True)
    output: Mapped[str | None] = mapped_column(sa.String(200))
