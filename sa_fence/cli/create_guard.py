"""``sa-fence create-guard``: the command over :func:`sa_fence.create_fence_guard`."""

from __future__ import annotations

from typing import TextIO

import sqlalchemy as sa

from ..db.guard import TRIGGER_NAME
from ..orm.create_guard import create_fence_guard, shown_table
from .check import EXIT_FINDINGS, EXIT_OK, hidden_password, refused, with_connection


def run(
    url: str,
    tables: list[str],
    *,
    column: str,
    schema: str | None,
    sequence: str,
    on_missing_token: str,
    out: TextIO,
    err: TextIO,
) -> int:
    """``sa-fence create-guard``: every table's guard in one transaction, or none.

    Exit status: 0 created; 1 a table, its fence column or the sequence is
    missing (nothing written); 2 bad argument; 3 database unreachable.
    """

    def body(conn: sa.Connection, _: object) -> int:
        table = tables[0]
        try:
            with conn.begin():
                for table in tables:
                    create_fence_guard(
                        conn,
                        table,
                        column,
                        schema=schema,
                        on_missing_token=on_missing_token,
                        sequence=sequence,
                    )
        except ValueError as exc:
            print(f"sa-fence create-guard: {exc}. Nothing was created.", file=err)
            return EXIT_FINDINGS
        except sa.exc.DBAPIError as exc:
            shown = shown_table(table, schema)
            fix = None
            if getattr(exc.orig, "sqlstate", None) == "42501":  # insufficient_privilege
                fix = (
                    f"run create-guard as the owner of {shown} (the role your migrations run "
                    "as): the guard's function is created in the table's schema and its "
                    "trigger replaced on the table"
                )
            doing = f"creating the guard of table {shown}"
            print(
                f"sa-fence create-guard: {refused(exc, doing, fix)}. Nothing was created.", file=err
            )
            return EXIT_FINDINGS
        for table in tables:
            print(
                f"created guard trigger {TRIGGER_NAME} on {shown_table(table, schema)} "
                f"(column {column}, on_missing_token={on_missing_token}, sequence "
                f"{sequence}) in {hidden_password(url)}",
                file=out,
            )
        return EXIT_OK

    return with_connection(url, None, err, body, command="sa-fence create-guard")
