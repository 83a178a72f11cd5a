"""Who holds a lease register row: the backends and prepared transactions a grant waits for.

Read on failure paths only (a grant's ``lock_timeout`` ran out: sqlstate 55P03) and by ``sa-fence
status``.  The grant's wait has ended by then, so ``pg_blocking_pids()`` (what blocks a wait in
progress) has nothing to say; the row has: its ``xmax`` is the xid of the one transaction holding
it (``FOR SHARE``, a commit check), or a MultiXactId of several.  SQL cannot tell which, so it is
read as both (as a MultiXactId only in the range ``pg_get_multixact_members()`` accepts: it raises
outside).  An xid counts only when a live transaction owns it: a backend holding its xid's lock
(``pg_locks``: a subtransaction's too, which ``pg_stat_activity.backend_xid`` never shows) or a
prepared transaction.  The ``xmax`` a finished transaction left matches neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, text

from .._failures import cause_text

_SQL = """\
WITH held AS (
    SELECT r.name, r.xmax FROM {register} r WHERE NOT r.xmax = 0{names}
), lockers AS (
    SELECT h.name, h.xmax AS xid FROM held h
    UNION
    SELECT h.name, m.xid FROM held h CROSS JOIN pg_catalog.pg_database d
     CROSS JOIN LATERAL pg_catalog.pg_get_multixact_members(
           CASE WHEN pg_catalog.mxid_age(h.xmax) > 0
                 AND pg_catalog.mxid_age(h.xmax) <= pg_catalog.mxid_age(d.datminmxid)
                THEN h.xmax END) m
     WHERE d.datname = pg_catalog.current_database()
)
SELECT k.name, CAST(CAST(k.xid AS text) AS bigint) AS xid, a.pid, a.state,
       pg_catalog.to_char(coalesce(a.xact_start, p.prepared) AT TIME ZONE 'UTC',
                          'YYYY-MM-DD"T"HH24:MI:SS"+00:00"') AS since,
       a.application_name, p.gid, p.owner, p.database
  FROM lockers k
  LEFT JOIN pg_catalog.pg_locks l ON l.locktype = 'transactionid' AND l.transactionid = k.xid
        AND l.mode = 'ExclusiveLock' AND l.granted AND l.pid IS NOT NULL
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
  LEFT JOIN pg_catalog.pg_prepared_xacts p ON p.transaction = k.xid
 WHERE l.pid IS NOT NULL OR p.gid IS NOT NULL
 ORDER BY k.name, since, xid"""


@dataclass(frozen=True)
class Blocker:
    """One live transaction holding the register row of lease ``name`` (JSON-ready)."""

    name: str
    xid: int
    pid: int | None  # None: a prepared transaction, which no backend runs
    state: str | None  # pg_stat_activity.state (None: another role's, not ours to see)
    since: str | None  # when its transaction began, or was prepared (ISO 8601, UTC)
    application_name: str | None
    gid: str | None  # a prepared transaction's, with its owner and database
    owner: str | None
    database: str | None

    def __str__(self) -> str:
        if self.gid is not None:
            return (
                f"prepared transaction {self.gid!r} (xid {self.xid}, prepared {self.since} "
                f"by {self.owner!r} in database {self.database!r}; COMMIT PREPARED or ROLLBACK "
                "PREPARED ends it)"
            )
        app = f", application_name {self.application_name!r}" if self.application_name else ""
        return (
            f"backend pid {self.pid} ({self.state or 'state not visible'}, its transaction "
            f"began {self.since}, xid {self.xid}{app})"
        )


def find(conn: Connection, register_sql: str, names: Sequence[str] | None = None) -> list[Blocker]:
    """The live transactions holding register rows (of ``names``; None: of every name)."""
    where = "" if names is None else " AND r.name = ANY(:names)"
    sql = text(_SQL.format(register=register_sql, names=where))
    rows = conn.execute(sql, {} if names is None else {"names": list(names)})
    return [Blocker(**row) for row in rows.mappings()]


def describe(engine: Engine, register_sql: str, name: str) -> str:
    """Who holds the register row of ``name``, as a sentence; best effort, on a connection
    of its own: a failure to tell says so, never raised over the grant's own error."""
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            found = find(conn, register_sql, [name])
    except Exception as exc:
        return f"sa-fence could not tell which backend holds it ({cause_text(exc)})."
    if not found:
        return (
            "sa-fence could not tell which backend holds it (no live one is named on the row now)."
        )
    return "It is held by " + "; and ".join(map(str, found)) + "."
