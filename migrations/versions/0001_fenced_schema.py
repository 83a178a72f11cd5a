"""The token sequence and the demo's fenced tables, each with its guard.

Revision ID: 0001_fenced_schema
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import sa_fence.alembic  # noqa: F401

revision = "0001_fenced_schema"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_fence_sequence()  # sa_fence_token_seq: bigint, CACHE 1, NO CYCLE
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("result", sa.String(200), nullable=True),
    )
    op.add_fence_column("jobs")
    # 'unchanged': code that does not know sa-fence yet (the demo's --unfenced
    # workers) may still UPDATE a job as long as it leaves the fence alone; no
    # writer can lower the fence or write with a stale token.
    op.create_fence_guard("jobs", on_missing_token="unchanged")
    op.create_table(
        "job_steps",
        sa.Column("job_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("step", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("output", sa.String(200), nullable=True),
    )
    op.add_fence_column("job_steps")
    op.create_fence_guard("job_steps")  # every writer must present a token


def downgrade() -> None:
    op.drop_fence_guard("job_steps")
    op.drop_table("job_steps")
    op.drop_fence_guard("jobs", on_missing_token="unchanged")
    op.drop_table("jobs")
    op.drop_fence_sequence()  # resets tokens: never downgrade past this in production
