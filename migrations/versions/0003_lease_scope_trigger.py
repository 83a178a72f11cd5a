"""Lease scope held by PostgreSQL at COMMIT: the scope table and its trigger.

``op.create_fence_register()`` is idempotent: on a database migrated to
0002 it keeps the register and its rows, replaces the commit check function
with its schema-qualified, ``search_path``-pinned form, and adds the UNLOGGED
table ``sa_fence_scope`` with the deferred constraint trigger that checks
every armed transaction at COMMIT and PREPARE TRANSACTION.

Revision ID: 0003_lease_scope_trigger
Revises: 0002_lease_register
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

import sa_fence.alembic  # noqa: F401

revision = "0003_lease_scope_trigger"
down_revision = "0002_lease_register"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_fence_register()


def downgrade() -> None:
    # Back to 0002: the register and its check function stay; only the scope
    # table (with its trigger) and the trigger's function go.
    op.execute("DROP TABLE IF EXISTS sa_fence_scope")
    op.execute("DROP FUNCTION IF EXISTS sa_fence_scope_check()")
