"""The lease register and its commit check function (lease-scoped fencing).

Revision ID: 0002_lease_register
Revises: 0001_fenced_schema
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

import sa_fence.alembic  # noqa: F401

revision = "0002_lease_register"
down_revision = "0001_fenced_schema"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # sa_fence_leases (tokens drawn from sa_fence_token_seq) and
    # sa_fence_check_lease(text, bigint), the check a bound session's COMMIT runs
    op.create_fence_register()


def downgrade() -> None:
    op.drop_fence_register()  # before 0001 drops the sequence its token default uses
