"""The arm carries the token alone, and only sa-fence's functions move the register.

``op.create_fence_register()`` is idempotent: on a database migrated to 0003 it keeps the
register and its rows and

- adds the unique index ``sa_fence_leases_token`` (tokens are unique across names, and the
  commit check finds the register row by the token alone);
- drops the scope table's ``name`` column (the arm is the token: no lease name is ever written
  as an SQL literal) and replaces ``sa_fence_check_lease(text, bigint)`` with
  ``sa_fence_check_lease(bigint)``;
- creates the SECURITY DEFINER functions ``sa_fence_grant``, ``sa_fence_withdraw`` and
  ``sa_fence_prune`` (EXECUTE revoked from PUBLIC) and makes the scope trigger's function
  SECURITY DEFINER, so the workers' role needs no INSERT, UPDATE or DELETE on the register
  (docs/topologies.md: GRANT EXECUTE on the three functions to that role, and revoke its
  writes on the register).

Stop the workers of the previous release first: their arms name a column this drops.

Revision ID: 0004_register_functions
Revises: 0003_lease_scope_trigger
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

import sa_fence.alembic  # noqa: F401

revision = "0004_register_functions"
down_revision = "0003_lease_scope_trigger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_fence_register()


def downgrade() -> None:
    # The functions of 0003's release cannot be made again from this one; the register,
    # its rows and the scope table stay, and the new functions are harmless to it.
    pass
