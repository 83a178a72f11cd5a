"""Retention of the lease register: ``Fencer.prune()`` (its command: :mod:`sa_fence.cli.prune`).

The register keeps one row per lease name forever.  Pruning deletes the rows of names nobody
holds that were last granted long ago, in batches in name order: scan the rows granted before
``now - older_than``, ask Redis which of those names are held now (one pipelined ``EXISTS`` per
batch; a held name is kept), then delete each row only while it still holds the token the scan
read (a grant in between survives), skipping a row locked at that moment.  A stale holder of a
pruned name is still refused at COMMIT; the one change is for a holder whose lease expired
without a newer grant, hence the required ``longest_lease``.  docs/operations.md ("Retention").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from .register import Register, pinned_register

#: Names read, checked in Redis and deleted per round trip.
BATCH = 1000
#: The most names a dry run lists (the count covers them all).
NAMES_LISTED = 100

Duration = float | int | timedelta


@dataclass(frozen=True)
class PruneResult:
    """What :meth:`sa_fence.Fencer.prune` removed (or, with ``dry_run``, would remove)."""

    #: register rows deleted (with ``dry_run``: that would be deleted)
    rows: int
    #: their size in the table, from ``pg_column_size`` of each row (index
    #: entries not counted); PostgreSQL reuses the space for new rows after
    #: VACUUM, and only VACUUM FULL gives it back to the operating system
    bytes: int
    #: rows old enough whose name is held in Redis now, kept
    held: int
    #: rows old enough and not held, but granted again before the delete (a new
    #: token) or locked by a grant or commit under way at that moment, kept
    regranted: int
    dry_run: bool
    #: with ``dry_run``: the names of the rows that would go, in name order, the first
    #: NAMES_LISTED of them (empty after a real prune)
    names: tuple[str, ...] = ()


def seconds(value: object, what: str) -> float:
    """A duration (seconds as a number, or a ``timedelta``) in seconds, > 0 and finite."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{what} must be a number of seconds or a datetime.timedelta, got "
            f"{type(value).__name__}: {value!r}"
        )
    if not math.isfinite(value) or value <= 0 or value > _CENTURY:  # (past it: a DB overflow)
        raise ValueError(f"{what} must be a duration > 0 and at most 100 years, got {value!r}")
    return float(value)


_CENTURY = 100 * 365.25 * 86400


def check_ages(older_than: object, longest_lease: object) -> float:
    """``older_than`` in seconds, refused when shorter than ``longest_lease``."""
    age = seconds(older_than, "older_than")
    longest = seconds(longest_lease, "longest_lease")
    if age < longest:
        raise ValueError(
            f"older_than ({format_duration(age)}) is shorter than longest_lease "
            f"({format_duration(longest)}): a holder granted less than longest_lease ago may "
            "still be working, and pruning its row would refuse its next commit. Prune only "
            "rows older than the longest a lease can last from its grant to its last "
            "commit (renewals included): pass older_than >= longest_lease"
        )
    return age


UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}


def format_duration(value: float) -> str:
    for unit, size in UNITS.items():
        if size > 1 and value >= size and value % size == 0:
            return f"{int(value // size)}{unit}"
    return f"{value:g}s"


def _delete_sql(register: Register, *, dry_run: bool) -> Any:
    """Compare-and-delete of (name, token) pairs, through the register's SECURITY DEFINER prune
    function (the workers' role may not delete register rows itself); a dry run counts them."""
    if not dry_run:
        return register.prune_sql()
    return sa.text(
        f"SELECT count(*), coalesce(sum(pg_column_size(r.*)), 0), "
        f"coalesce((array_agg(r.name ORDER BY r.name))[1:{NAMES_LISTED}], '{{}}') "
        f"FROM {register.table_sql} r, "
        "unnest(CAST(:names AS text[]), CAST(:tokens AS bigint[])) AS d(name, token) "
        "WHERE r.name = d.name AND r.token = d.token"
    )


def prune(
    engine: sa.Engine,
    held: Callable[[Sequence[str]], Sequence[bool]],
    sequence: str,
    *,
    older_than: Duration,
    longest_lease: Duration,
    dry_run: bool = False,
    batch: int = BATCH,
) -> PruneResult:
    """Prune ``sequence``'s register through ``engine`` (see the module);
    ``held(names)`` says which names Redis holds now."""
    age = check_ages(older_than, longest_lease)
    with engine.connect() as conn:
        return prune_on(conn, held, sequence, age, dry_run=dry_run, batch=batch)


def prune_on(
    conn: sa.Connection,
    held: Callable[[Sequence[str]], Sequence[bool]],
    sequence: str,
    age: float,
    *,
    dry_run: bool,
    batch: int = BATCH,
) -> PruneResult:
    """:func:`prune` on a connection, ``age`` already checked (seconds)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a whole number >= 1, got {batch!r}")
    if not isinstance(dry_run, bool):  # ("false" would be true, None false: a real prune)
        raise TypeError(f"dry_run must be True or False, got {dry_run!r}")
    removed = size = kept_held = regranted = 0
    listed: list[str] = []
    # schema-qualified from here on: nothing on the search_path stands in
    register = pinned_register(conn, sequence)
    exists = conn.execute(
        sa.text("SELECT to_regclass(:t) IS NOT NULL"), {"t": register.table_sql}
    ).scalar_one()
    conn.rollback()
    if not exists:
        raise LookupError(
            f"there is no lease register {Register(sequence).table_display} for sequence "
            f"{sequence!r}: nothing to prune (run `sa-fence check`, or pass --sequence)"
        )
    scan = sa.text(
        f"SELECT r.name, r.token FROM {register.table_sql} r "
        "WHERE r.name > :after AND r.granted_at < pg_catalog.clock_timestamp() - "
        "pg_catalog.make_interval(secs => :age) ORDER BY r.name LIMIT :batch"
    )
    after = ""
    while True:
        rows = conn.execute(scan, {"after": after, "age": age, "batch": batch}).all()
        conn.rollback()  # no snapshot or lock held while Redis is asked
        if not rows:
            break
        after = rows[-1].name
        flags = held([row.name for row in rows])
        prunable = [row for row, is_held in zip(rows, flags, strict=True) if not is_held]
        kept_held += len(rows) - len(prunable)
        if prunable:
            count, bytes_, *would_go = conn.execute(
                _delete_sql(register, dry_run=dry_run),
                {
                    "names": [row.name for row in prunable],
                    "tokens": [int(row.token) for row in prunable],
                },
            ).one()
            conn.commit()
            if would_go:  # a dry run: the names too
                listed += would_go[0][: NAMES_LISTED - len(listed)]
            removed += int(count)
            size += int(bytes_)
            regranted += len(prunable) - int(count)
        if len(rows) < batch:
            break
    return PruneResult(removed, size, kept_held, regranted, dry_run, tuple(listed))


def redis_held(client: Any, key_prefix: str) -> Callable[[Sequence[str]], Sequence[bool]]:
    """``held(names)`` for a redis-py client: one pipelined EXISTS per name."""
    return lambda names: [bool(reply) for reply in _exists(client, key_prefix, names)]


def async_redis_held(client: Any, key_prefix: str) -> Callable[[Sequence[str]], Sequence[bool]]:
    """``held(names)`` for a ``redis.asyncio`` client, called from the sync code
    that ``greenlet_spawn`` runs (SQLAlchemy's bridge: it awaits the pipeline)."""
    from sqlalchemy.util import await_only

    return lambda names: [bool(reply) for reply in await_only(_exists(client, key_prefix, names))]


def _exists(client: Any, key_prefix: str, names: Sequence[str]) -> Any:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(key_prefix + name)
    return pipe.execute()
