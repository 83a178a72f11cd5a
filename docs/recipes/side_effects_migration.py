"""Alembic revision: procrastinate's queue tables, beside the fenced rows.

The SQL is the schema procrastinate applies itself (``procrastinate schema
--apply``), taken from the installed procrastinate, so the revision creates
exactly what that release expects.  When you upgrade procrastinate, its
release notes list the SQL files to run (``procrastinate schema
--migrations-path`` prints where they are): add one revision per file, with
``op.execute(Path(SchemaManager.get_migrations_path(), NAME).read_text())``.

Revision ID: 0002_procrastinate
Revises: 0001_sa_fence
"""

from __future__ import annotations

from alembic import op
from procrastinate.schema import SchemaManager

revision = "0002_procrastinate"
down_revision = "0001_sa_fence"
branch_labels = None
depends_on = None

#: Everything procrastinate created in the current schema (its objects are all
#: named procrastinate_*): tables (with their triggers), then functions and
#: procedures, then types.
DROP_PROCRASTINATE = r"""
DO $$
DECLARE
    obj record;
BEGIN
    FOR obj IN SELECT c.oid::regclass AS name FROM pg_class c
               WHERE c.relkind = 'r' AND c.relname LIKE 'procrastinate\_%'
                 AND c.relnamespace = current_schema()::regnamespace LOOP
        EXECUTE format('DROP TABLE %s CASCADE', obj.name);
    END LOOP;
    FOR obj IN SELECT p.oid::regprocedure AS name, p.prokind FROM pg_proc p
               WHERE p.proname LIKE 'procrastinate\_%'
                 AND p.pronamespace = current_schema()::regnamespace LOOP
        EXECUTE format('DROP %s %s CASCADE',
                       CASE obj.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, obj.name);
    END LOOP;
    FOR obj IN SELECT t.oid::regtype AS name FROM pg_type t
               WHERE t.typname LIKE 'procrastinate\_%' AND t.typtype IN ('e', 'c')
                 AND t.typnamespace = current_schema()::regnamespace LOOP
        EXECUTE format('DROP TYPE %s CASCADE', obj.name);
    END LOOP;
END
$$
"""


def upgrade() -> None:
    op.execute(SchemaManager.get_schema())


def downgrade() -> None:
    op.execute(DROP_PROCRASTINATE)
